"""Launches and GPU time of two small decode-step ops, each in two equivalent formulations.

A full-depth decode step at concurrency 4 is ~2,100 kernel launches, most of them small XLA fusions of 1-2 us
(BENCHMARKS.md, "Full-depth decode re-measured"). Two of them have a formulation XLA:GPU compiles to fewer
kernels, with the same result:

  rope:   the query path of one attention layer, q = rope(gemma_norm(x @ Wq)), at one GPU's shard of an 8-way
          split of M3 (8 heads x 128, RoPE on the first 64 channels): the slice / concatenate rotation
          (m3jax.layers.rope.rope_by_slices) against the half-swap with full-width tables (rope_by_swap).
  router: fp32 router logits and sigmoid scores of T tokens, x [T, 6144] bf16 @ W [6144, 128] fp32: the
          HIGHEST-precision dot (pallas_kernels.moe.reference.router_scores, what the model runs) against one
          broadcast multiply-reduce (router_scores_reduce below; measured, not adopted: BENCHMARKS.md).

Each variant is jitted alone and profiled with CUPTI (every launch of one call, kernel time summed); each
pair is checked against each other (rope: bitwise; router: max |difference| of the logits).

  PYTHONPATH=$PWD JAX_PLATFORMS=cuda python3 scripts/bench_decode_ops.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_generate import kernel_profile  # pylint: disable=g-import-not-at-top
from m3jax.layers.norms import gemma_rms_norm  # pylint: disable=g-import-not-at-top
from m3jax.layers.params import project  # pylint: disable=g-import-not-at-top
from m3jax.layers.rope import rope_by_slices, rope_by_swap, rope_cos_sin  # pylint: disable=g-import-not-at-top
from pallas_kernels.moe.reference import router_scores  # pylint: disable=g-import-not-at-top

HIDDEN, HEADS, HEAD_DIM, ROTARY, EXPERTS = 6144, 8, 128, 64, 128


def router_scores_reduce(x: jax.Array, router_w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """router_scores (fp32 logits [T, E], sigmoid scores) as a broadcast multiply-reduce over H."""
  logits = jnp.sum(x.astype(jnp.float32)[:, :, None] * router_w.astype(jnp.float32)[None], axis=1)
  return logits, jax.nn.sigmoid(logits)


def profile(fn, *args) -> dict:
  """CUPTI launches and GPU us of one call of jitted fn (compiled and warmed first), and its output."""
  out = jax.block_until_ready(fn(*args))
  prof = kernel_profile(fn, *args)
  return {"launches": prof["launches"], "gpu_us": prof["gpu_us"], "kernels": prof["sequence"]}, out


def bench_rope(batch: int) -> dict:
  keys = jax.random.split(jax.random.key(batch), 3)
  x = jax.random.normal(keys[0], (batch, 1, HIDDEN), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (HIDDEN, HEADS, HEAD_DIM), jnp.float32) * HIDDEN ** -0.5).astype(jnp.bfloat16)
  norm_w = jax.random.normal(keys[2], (HEAD_DIM,), jnp.bfloat16) * 0.1
  positions = jnp.arange(batch, dtype=jnp.int32)[:, None] * 997 + 5
  cos, sin = rope_cos_sin(positions, ROTARY, 5e6)
  row = {}
  outs = {}
  for name, rope in (("slices", rope_by_slices), ("swap", rope_by_swap)):
    fn = jax.jit(lambda x, w, nw, c, s, rope=rope: rope(gemma_rms_norm(project("bsh,hnd->bsnd", x, w), nw, 1e-6),
                                                          c, s))
    row[name], outs[name] = profile(fn, x, w, norm_w, cos, sin)
  row["bitwise_equal"] = bool(jnp.array_equal(outs["slices"], outs["swap"]))
  return row


def bench_router(tokens: int) -> dict:
  keys = jax.random.split(jax.random.key(tokens), 2)
  x = jax.random.normal(keys[0], (tokens, HIDDEN), jnp.bfloat16)
  w = jax.random.normal(keys[1], (HIDDEN, EXPERTS), jnp.float32) * HIDDEN ** -0.5
  row = {}
  outs = {}
  for name, scores in (("dot", router_scores), ("reduce", router_scores_reduce)):
    row[name], outs[name] = profile(jax.jit(scores), x, w)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for name in outs:
    row[name]["max_abs_err_vs_fp64"] = float(np.max(np.abs(np.asarray(outs[name][0], np.float64) - exact)))
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=None)
  parser.add_argument("--batches", default="4,64", help="decode batch sizes for the query path")
  parser.add_argument("--tokens", default="4,16,64", help="token counts for the router")
  args = parser.parse_args()
  report = {"device": jax.devices()[0].device_kind}
  for b in [int(v) for v in args.batches.split(",") if v]:
    row = report[f"rope_b{b}"] = bench_rope(b)
    print(f"query path, batch {b}: slices {row['slices']['launches']} launches {row['slices']['gpu_us']} us; "
          f"swap {row['swap']['launches']} launches {row['swap']['gpu_us']} us; bitwise equal "
          f"{row['bitwise_equal']}", flush=True)
  for t in [int(v) for v in args.tokens.split(",") if v]:
    row = report[f"router_t{t}"] = bench_router(t)
    print(f"router, {t} tokens: " + "; ".join(
        f"{name} {row[name]['launches']} launches {row[name]['gpu_us']} us (max |err| vs fp64 "
        f"{row[name]['max_abs_err_vs_fp64']:.2e})" for name in ("dot", "reduce")), flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
