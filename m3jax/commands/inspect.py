"""``m3jax inspect PATH``: config summary, parameter count by component, dtypes and bytes on disk of a checkpoint
directory (safetensors source or m3jax-converted); reads metadata only."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("inspect", help="summarise a checkpoint (config, parameters by component, dtypes, size)",
                     description=__doc__)
  p.add_argument("path", help="checkpoint directory (safetensors or `m3jax convert` output)")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  from m3jax.checkpoint.inspect import inspect_checkpoint  # pylint: disable=g-import-not-at-top

  print("\n".join(inspect_checkpoint(args.path).lines()))
  return 0
