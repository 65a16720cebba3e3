"""``m3jax demo``: build the tiny built-in checkpoint (original layout + BPE tokenizer) and generate from it."""

from __future__ import annotations

import argparse
import os
import tempfile

from m3jax.commands import generate as generate_cmd


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("demo", help="end-to-end demo on a tiny built-in M3 (random weights)")
  p.add_argument("--out", default=None, help="where to write the demo checkpoint (default: a temp dir)")
  generate_cmd.add_generation_arguments(p)
  p.set_defaults(func=run, prompt=None)


def run(args: argparse.Namespace) -> int:
  from m3jax.demo import build_demo_checkpoint  # pylint: disable=g-import-not-at-top

  out = args.out or os.path.join(tempfile.mkdtemp(prefix="m3jax-demo-"), "tiny-m3")
  build_demo_checkpoint(out)
  print(f"[m3jax] wrote a tiny M3 checkpoint (original MiniMax layout, random weights) to {out}")
  if args.prompt is None and args.prompt_ids is None and args.prompt_file is None:
    args.prompt = "What is sparse attention?"
    args.chat = True
  args.checkpoint = out
  return generate_cmd.run(args)
