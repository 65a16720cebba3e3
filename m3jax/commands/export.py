"""``m3jax export DST OUT``: an m3jax checkpoint (from ``m3jax convert``) -> original-layout safetensors + config.json
that HF transformers ``from_pretrained`` (and ``m3jax convert``) read back."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("export", help="write an m3jax checkpoint back as original-layout safetensors",
                     description=__doc__)
  p.add_argument("src", metavar="DST", help="directory written by `m3jax convert`")
  p.add_argument("out", metavar="OUT", help="output directory (written atomically; must not exist unless --force)")
  p.add_argument("--force", action="store_true", help="replace an existing OUT")
  p.add_argument("--max-shard-mb", type=int, default=5 * 1024, help="safetensors shard size limit (MiB)")
  p.add_argument("--piece-mb", type=int, default=128,
                 help="large arrays are read and written in pieces of at most this many MiB (default 128)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from m3jax.checkpoint.export import export  # pylint: disable=g-import-not-at-top

  for option, value in (("--piece-mb", args.piece_mb), ("--max-shard-mb", args.max_shard_mb)):
    if value < 1:
      raise ValueError(f"{option} must be >= 1 (MiB), got {value}")
  summary = export(args.src, args.out, force=args.force, max_shard_bytes=args.max_shard_mb << 20,
                   max_piece_bytes=args.piece_mb << 20, progress=not args.no_progress)
  print("\n".join(summary.lines()))
  return 0
