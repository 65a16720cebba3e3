"""``m3jax forward``: one full forward pass (a built-in tiny model or a checkpoint) and a logits summary.

``--selection-stats`` also prints, per sparse layer, how much adjacent queries' indexer selections overlap
(m3jax.research.selection_locality: what bounds the sparse attention kernel's prefill speed), and
``--save-selections F.npz`` writes the selections (``layer_<i>`` int32 [1, S, G, T]) for
``scripts/bench_attention.py --selections F.npz``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.token_ids import parse_token_ids


def add_parser(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("forward", help="run one forward pass and print a logits summary")
  p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: a built-in tiny random model)")
  p.add_argument("--prompt-ids", default=None, help="comma-separated token ids (default: 300 random ids)")
  p.add_argument("--prompt-file", default=None, help="a text file, tokenized with the checkpoint's tokenizer.json")
  p.add_argument("--selection-stats", action="store_true",
                 help="print per sparse layer the overlap of adjacent queries' selected blocks")
  p.add_argument("--save-selections", default=None, metavar="F.npz",
                 help="write every sparse layer's selected blocks (layer_<i>: int32 [1, S, G, T])")
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
  if args.prompt_ids and args.prompt_file:
    raise ValueError("pass --prompt-ids or --prompt-file, not both")
  if args.prompt_ids:
    ids = np.asarray([parse_token_ids(args.prompt_ids)], np.int32)
  elif args.prompt_file:
    if not args.checkpoint:
      raise ValueError("--prompt-file needs a checkpoint directory (its tokenizer.json)")
    from m3jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top

    with open(args.prompt_file, encoding="utf-8") as f:
      ids = np.asarray([load_tokenizer(args.checkpoint).encode(f.read(), add_special_tokens=False).ids], np.int32)
    if ids.shape[1] == 0:
      raise ValueError(f"{args.prompt_file}: no tokens")
  else:
    ids = np.asarray(jax.random.randint(jax.random.key(0), (1, 300), 0, vocab), np.int32)
  want_selections = args.selection_stats or args.save_selections
  start = time.perf_counter()
  if want_selections:
    from m3jax.research import Collect  # pylint: disable=g-import-not-at-top

    result = model.forward(jnp.asarray(ids), collect=Collect(block_ids=True))
    logits = np.asarray(result.logits)
    selections = {f"layer_{i}": np.asarray(rec["block_ids"]) for i, rec in enumerate(result.intermediates)
                  if "block_ids" in rec}
  else:
    logits = np.asarray(model(ids))
  elapsed = time.perf_counter() - start
  print(f"model: {source}")
  print(f"backend: {jax.default_backend()}, kernels: {model.kernels}, dtype: {model.dtype.name}")
  print(f"input: {ids.shape[1]} tokens -> logits {list(logits.shape)} float32 in {elapsed:.2f}s (incl. compile)")
  print(f"next-token argmax: {int(logits[0, -1].argmax())}, logits mean {logits.mean():+.4f} std {logits.std():.4f}")
  if want_selections:
    _report_selections(selections, ids.shape[1], model.config.text, args)
  return 0


def _report_selections(selections: dict[str, np.ndarray], length: int, text_cfg, args: argparse.Namespace) -> None:
  from m3jax.research import selection_locality  # pylint: disable=g-import-not-at-top

  if not selections:
    raise ValueError("the model has no sparse attention layer: no selections to report")
  positions = np.arange(length, dtype=np.int32)[None]
  if args.selection_stats:
    print(f"selection locality ({len(selections)} sparse layers, {length} tokens, block {text_cfg.index_block_size}, "
          "union = blocks per (tile of Q queries, KV group); efficiency = selected / (Q x union)):")
    for name, ids in selections.items():
      stats = selection_locality(ids, positions)
      print(f"  {name}: selected {stats[4]['mean_selected']:.2f}/query, union Q=4 {stats[4]['mean_union']:.2f} "
            f"(efficiency {stats[4]['row_efficiency']:.3f}), Q=8 {stats[8]['mean_union']:.2f} "
            f"(efficiency {stats[8]['row_efficiency']:.3f})")
  if args.save_selections:
    np.savez_compressed(args.save_selections, positions=positions, **selections)
    print(f"wrote {len(selections)} layers' selections to {args.save_selections}")
