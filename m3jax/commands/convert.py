"""``m3jax convert SRC DST``: a safetensors checkpoint (original MiniMax or HF layout, plain or quantized) ->
an m3jax Orbax checkpoint that ``m3jax.load`` restores straight into (sharded) arrays."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("convert", help="convert a safetensors checkpoint into an m3jax (Orbax) checkpoint",
                     description=__doc__)
  p.add_argument("src", help="checkpoint directory: config.json + *.safetensors (single or sharded with an index)")
  p.add_argument("dst", help="output directory (written atomically; must not exist unless --force)")
  p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                 help="parameter dtype (auto: the checkpoint's own; quantized weights are dequantized to it)")
  p.add_argument("--layout", default="auto", choices=("auto", "original", "hf", "hf_text"),
                 help="tensor naming of SRC (auto-detected by default)")
  p.add_argument("--force", action="store_true", help="replace an existing DST")
  p.add_argument("--text-only", action="store_true",
                 help="drop the vision tower + projector (the output config has no vision_config)")
  p.add_argument("--drop-mtp", action="store_true", help="skip the MTP (mtp.*) tensors instead of keeping them")
  p.add_argument("--piece-mb", type=int, default=128,
                 help="large arrays (stacked experts, embedding, LM head) are built and written in pieces of at most "
                      "this many MiB (default 128); peak memory is about 3x this plus 256 MiB in flight")
  q = p.add_mutually_exclusive_group()
  q.add_argument("--keep-quantized", action="store_true",
                 help="store the weights SRC keeps in MXFP8 / FP8-block as they are (fp8 values + scales), not "
                      "dequantized; m3jax.load restores them in fp8")
  q.add_argument("--quantize", choices=("mxfp8",), default=None,
                 help="quantize a bf16 / fp32 SRC's linear weights (experts, shared expert, dense MLP, attention and "
                      "indexer projections) into MXFP8 on the way")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from m3jax.checkpoint.convert import convert  # pylint: disable=g-import-not-at-top

  if args.piece_mb < 1:
    raise ValueError(f"--piece-mb must be >= 1 (MiB), got {args.piece_mb}")
  summary = convert(args.src, args.dst, dtype=args.dtype, layout=args.layout, force=args.force,
                    keep_mtp=not args.drop_mtp, text_only=args.text_only, max_piece_bytes=args.piece_mb << 20,
                    progress=not args.no_progress, keep_quantized=args.keep_quantized, quantize=args.quantize)
  print("\n".join(summary.lines()))
  return 0
