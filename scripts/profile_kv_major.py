"""Runs the KV-major sparse prefill at M3 dims on random indexer selections, for timing and for Nsight Compute.

  PYTHONPATH=$PWD python scripts/profile_kv_major.py [--size 32768] [--staging q_buffer] [--chunks 8]
  ncu --clock-control none -k regex:kv_major --launch-skip 2 --launch-count 1 --set full -o $OUT/kvm \
    python3 scripts/profile_kv_major.py --calls 1 --no-breakdown

Prints the CUPTI time of each kernel launch of one call (plan, the kernel's passes, the merge) and the result's
relative L2 error against the XLA reference on the last --check queries. --calls N makes N calls in total
(the first compiles); under ncu, --calls 1 and --launch-skip pick which pass of which call is profiled.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from pallas_kernels.attention import KvMajorBlockSizes, sparse_attention, sparse_attention_reference
from pallas_kernels.indexer import indexer_topk

NQ, NKV, D, HI, DI, TOPK, BLOCK = 64, 4, 128, 4, 128, 16, 128


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", type=int, default=32768, help="prefill length (queries = keys)")
  ap.add_argument("--staging", default="q_buffer", help="KvMajorBlockSizes.output_staging")
  ap.add_argument("--chunks", type=int, default=8, help="KvMajorBlockSizes.chunks_per_item")
  ap.add_argument("--calls", type=int, default=3, help="calls in total; the breakdown is of the last")
  ap.add_argument("--check", type=int, default=512, help="queries checked against the XLA reference (0: none)")
  ap.add_argument("--interpret", action="store_true", help="CPU dry run in GPU interpret mode (small --size)")
  ap.add_argument("--no-breakdown", action="store_true", help="plain calls, no CUPTI (under ncu)")
  args = ap.parse_args()
  s = args.size
  keys = jax.random.split(jax.random.key(0), 5)
  idx_q = jax.random.normal(keys[0], (1, s, HI, DI), jnp.bfloat16)
  idx_k = jax.random.normal(keys[1], (1, s, DI), jnp.bfloat16)
  q = jax.random.normal(keys[2], (1, s, NQ, D), jnp.bfloat16)
  k = jax.random.normal(keys[3], (1, s, NKV, D), jnp.bfloat16)
  v = jax.random.normal(keys[4], (1, s, NKV, D), jnp.bfloat16)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  ids = indexer_topk(idx_q, idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1, interpret=args.interpret)
  bs = KvMajorBlockSizes(chunks_per_item=args.chunks, output_staging=args.staging)
  fn = jax.jit(functools.partial(sparse_attention, block_size=BLOCK, scale=D ** -0.5, block_sizes=bs,
                                 interpret=args.interpret))
  for _ in range(args.calls - 1):
    out = jax.block_until_ready(fn(q, k, v, ids, pos))
  try:
    if args.no_breakdown:
      raise RuntimeError("--no-breakdown")
    from jax.experimental.mosaic.gpu import profiler
    out, per_kernel = profiler.measure(fn, aggregate=False)(q, k, v, ids, pos)
    launches = [(name[:70], round(ms, 3)) for name, ms in per_kernel]
  except Exception as e:  # noqa: BLE001 - under ncu CUPTI is taken; the call still runs
    out = jax.block_until_ready(fn(q, k, v, ids, pos))
    launches = f"no CUPTI breakdown: {type(e).__name__}"
  row = dict(size=s, staging=args.staging, chunks=args.chunks, launches=launches)
  if args.check:
    n = args.check
    ref = sparse_attention_reference(q[:, -n:], k, v, ids[:, -n:], pos[:, -n:], block_size=BLOCK, scale=D ** -0.5)
    got = out[:, -n:].astype(jnp.float32)
    row["rel_err_last_queries"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
  print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
