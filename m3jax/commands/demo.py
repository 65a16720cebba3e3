"""``m3jax demo``: generate from the small trained M3 the package carries (m3jax/assets/m3-small-kjv, trained on the
King James Bible by scripts/train_small.sh); ``--random`` (or a package without it) builds the tiny random-weight
checkpoint (original layout + BPE tokenizer) instead."""

from __future__ import annotations

import argparse
import os
import tempfile

from m3jax.commands import generate as generate_cmd


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("demo", help="end-to-end demo on the built-in small trained M3 (or a random tiny one)")
  p.add_argument("--random", action="store_true",
                 help="use the tiny random-weight M3 (built on the fly) instead of the trained one")
  p.add_argument("--out", default=None, help="where to write the random demo checkpoint (default: a temp dir)")
  generate_cmd.add_generation_arguments(p)
  p.set_defaults(func=run, prompt=None)


def run(args: argparse.Namespace) -> int:
  from m3jax.demo import TRAINED_DEMO_PROMPT, build_demo_checkpoint, trained_demo_checkpoint  # pylint: disable=g-import-not-at-top

  trained = None if args.random else trained_demo_checkpoint()
  if trained is not None:
    if args.out is not None:
      raise ValueError("--out writes the random demo checkpoint; add --random, or drop --out for the trained model")
    print(f"[m3jax] the small trained M3 (King James Bible, m3jax/assets): {trained}")
    if args.prompt is None and args.prompt_ids is None and args.prompt_file is None:
      args.prompt = TRAINED_DEMO_PROMPT
    args.checkpoint = trained
    return generate_cmd.run(args)
  if not args.random:
    print("[m3jax] this package carries no trained demo model; using a tiny random-weight M3 (--random)")
  out = args.out or os.path.join(tempfile.mkdtemp(prefix="m3jax-demo-"), "tiny-m3")
  build_demo_checkpoint(out)
  print(f"[m3jax] wrote a tiny M3 checkpoint (original MiniMax layout, random weights) to {out}")
  if args.prompt is None and args.prompt_ids is None and args.prompt_file is None:
    args.prompt = "What is sparse attention?"
    args.chat = True
  args.checkpoint = out
  return generate_cmd.run(args)
