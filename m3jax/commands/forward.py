"""``m3jax forward``: one full forward pass (a built-in tiny model or a checkpoint) and a logits summary."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("forward", help="run one forward pass and print a logits summary")
  p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: a built-in tiny random model)")
  p.add_argument("--prompt-ids", default=None, help="comma-separated token ids (default: 300 random ids)")
  p.add_argument("--kernels", default=None, help="reference | pallas | auto (default $M3JAX_KERNELS or auto)")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  import m3jax  # pylint: disable=g-import-not-at-top

  if args.checkpoint:
    model = m3jax.load(args.checkpoint, kernels=args.kernels)
    source = args.checkpoint
  else:
    model = m3jax.M3ForCausalLM(m3jax.tiny(block_size=16), dtype=jnp.float32, kernels=args.kernels,
                                rngs=nnx.Rngs(0))
    source = "built-in tiny M3 (random weights, 4 layers: full/sparse attention x dense/MoE MLP)"
  vocab = model.config.text.vocab_size
  if args.prompt_ids:
    ids = np.asarray([[int(t) for t in args.prompt_ids.split(",")]], np.int32)
  else:
    ids = np.asarray(jax.random.randint(jax.random.key(0), (1, 300), 0, vocab), np.int32)
  start = time.perf_counter()
  logits = np.asarray(model(ids))
  elapsed = time.perf_counter() - start
  print(f"model: {source}")
  print(f"backend: {jax.default_backend()}, kernels: {model.kernels}, dtype: {model.dtype.name}")
  print(f"input: {ids.shape[1]} tokens -> logits {list(logits.shape)} float32 in {elapsed:.2f}s (incl. compile)")
  print(f"next-token argmax: {int(logits[0, -1].argmax())}, logits mean {logits.mean():+.4f} std {logits.std():.4f}")
  return 0
