"""Runs the KV-major sparse prefill at M3 dims on random indexer selections: per-pass kernel times, and the
times of variants that leave one stage of the kernel out (to place the time inside it without counters).

  PYTHONPATH=$PWD python scripts/profile_kv_major.py [--size 32768] [--staging q_buffer] [--chunks 8] [--wgs 1] \
    [--ablations none,no_stores,no_pv,no_mask,no_wgmma]
  ncu --clock-control none -k regex:kv_major --launch-skip 2 --launch-count 1 --set full -o $OUT/kvm \
    python3 scripts/profile_kv_major.py --calls 1 --no-breakdown --ablations none

Each ablation patches a helper of kernel_sm90_kv_major.py for the time of its run (timing only: the output of
any but "none" is wrong and is not checked):
  no_stores  the partial outputs and log-sum-exps are not copied to global memory;
  no_pv      O = P.V is replaced by zeros (the softmax still runs: l is used);
  no_mask    the token-causal mask is not applied;
  no_wgmma   neither matmul is issued (S and O read uninitialised accumulators).
Prints one JSON row per ablation: the CUPTI time of every launch of the kernel in the last call (one per pass
of 8192 queries), the merge's time, and for "none" the relative L2 error against the XLA reference on the last
--check queries.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import types

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention import KvMajorBlockSizes, sparse_attention, sparse_attention_reference
from pallas_kernels.attention import kernel_sm90_kv_major as kernel_module
from pallas_kernels.attention.config import ROWS_PER_TILE
from pallas_kernels.indexer import indexer_topk

NQ, NKV, D, HI, DI, TOPK, BLOCK = 64, 4, 128, 4, 128, 16, 128


def _plgpu_without(**overrides) -> types.SimpleNamespace:
  """The plgpu module's names, some replaced."""
  names = {name: getattr(plgpu, name) for name in dir(plgpu) if not name.startswith("__")}
  return types.SimpleNamespace(**{**names, **overrides})


def _no_op(*args, **kwargs) -> None:
  del args, kwargs


def _zeros_pv(p16, p_smem, v_smem, head_dim):
  del p16, p_smem, v_smem
  return plgpu.layout_cast(jnp.zeros((ROWS_PER_TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA)


ABLATIONS = {
    "none": {},
    "no_stores": {"plgpu": _plgpu_without(copy_smem_to_gmem=_no_op)},
    "no_pv": {"p_times_v": _zeros_pv},
    "no_mask": {"mask_invisible_keys": lambda s, limit, block: s},
    "no_wgmma": {"plgpu": _plgpu_without(wgmma=_no_op)},
}


@contextlib.contextmanager
def ablated(name: str):
  """Patches kernel_sm90_kv_major's globals for one ablation (and clears jax's caches around it, so that the
  kernel is traced again)."""
  saved = {attr: getattr(kernel_module, attr) for attr in ABLATIONS[name]}
  jax.clear_caches()
  try:
    for attr, value in ABLATIONS[name].items():
      setattr(kernel_module, attr, value)
    yield
  finally:
    for attr, value in saved.items():
      setattr(kernel_module, attr, value)
    jax.clear_caches()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", type=int, default=32768, help="prefill length (queries = keys)")
  ap.add_argument("--staging", default="q_buffer", help="KvMajorBlockSizes.output_staging")
  ap.add_argument("--chunks", type=int, default=8, help="KvMajorBlockSizes.chunks_per_item")
  ap.add_argument("--wgs", type=int, default=1, help="KvMajorBlockSizes.compute_wgs")
  ap.add_argument("--configs", default=None, metavar="W:C:STAGING,...",
                  help="several (compute_wgs, chunks_per_item, output_staging) in one process (overrides the three)")
  ap.add_argument("--ablations", default="none", help=f"comma list of {', '.join(ABLATIONS)}")
  ap.add_argument("--calls", type=int, default=3, help="calls per ablation; the times are of the last")
  ap.add_argument("--check", type=int, default=512, help="queries checked against the XLA reference (0: none)")
  ap.add_argument("--interpret", action="store_true", help="CPU dry run in GPU interpret mode (small --size)")
  ap.add_argument("--no-breakdown", action="store_true", help="plain calls, no CUPTI (under ncu)")
  args = ap.parse_args()
  names = args.ablations.split(",")
  if unknown := set(names) - set(ABLATIONS):
    raise SystemExit(f"unknown ablations {sorted(unknown)}; choose from {list(ABLATIONS)}")
  s = args.size
  keys = jax.random.split(jax.random.key(0), 5)
  idx_q = jax.random.normal(keys[0], (1, s, HI, DI), jnp.bfloat16)
  idx_k = jax.random.normal(keys[1], (1, s, DI), jnp.bfloat16)
  q = jax.random.normal(keys[2], (1, s, NQ, D), jnp.bfloat16)
  k = jax.random.normal(keys[3], (1, s, NKV, D), jnp.bfloat16)
  v = jax.random.normal(keys[4], (1, s, NKV, D), jnp.bfloat16)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  ids = indexer_topk(idx_q, idx_k, pos, block_size=BLOCK, topk=TOPK, local_blocks=1, interpret=args.interpret)
  if args.configs:
    configs = [(int(w), int(c), staging) for w, c, staging in (x.split(":") for x in args.configs.split(","))]
  else:
    configs = [(args.wgs, args.chunks, args.staging)]
  call_args = (q, k, v, ids, pos)
  for (wgs, chunks, staging), name in ((config, name) for config in configs for name in names):
    bs = KvMajorBlockSizes(chunks_per_item=chunks, output_staging=staging, compute_wgs=wgs)
    row = dict(size=s, staging=staging, chunks=chunks, wgs=wgs, ablation=name)
    try:
      row.update(_measure(name, bs, call_args, args))
    except Exception as e:  # noqa: BLE001 - one failing configuration does not stop the others
      row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(row), flush=True)


def _measure(name: str, bs: KvMajorBlockSizes, call_args, args) -> dict:
  """Times one configuration under one ablation (and checks it when the ablation is "none")."""
  q, k, v, ids, pos = call_args
  row = {}
  with ablated(name):
    fn = jax.jit(functools.partial(sparse_attention, block_size=BLOCK, scale=D ** -0.5, block_sizes=bs,
                                   interpret=args.interpret))
    for _ in range(args.calls - 1):
      out = jax.block_until_ready(fn(*call_args))
    try:
      if args.no_breakdown:
        raise RuntimeError("--no-breakdown")
      from jax.experimental.mosaic.gpu import profiler
      out, per_kernel = profiler.measure(fn, aggregate=False)(*call_args)
      passes = [ms for kernel, ms in per_kernel if "kv_major" in kernel]
      row.update(kernel_ms=[round(ms, 3) for ms in passes], kernel_median_ms=round(statistics.median(passes), 3),
                 merge_ms=round(sum(ms for kernel, ms in per_kernel if "dynamic_update_slice" in kernel), 3),
                 call_ms=round(sum(ms for _, ms in per_kernel), 3))
    except Exception as e:  # noqa: BLE001 - no CUPTI (interpret mode, ncu): the call still runs
      out = jax.block_until_ready(fn(*call_args))
      row["breakdown"] = f"none: {type(e).__name__}: {e}"[:120]
    if name == "none" and args.check:
      n = args.check
      ref = sparse_attention_reference(q[:, -n:], k, v, ids[:, -n:], pos[:, -n:], block_size=BLOCK,
                                       scale=D ** -0.5)
      row["rel_err_last_queries"] = float(jnp.linalg.norm(out[:, -n:].astype(jnp.float32) - ref)
                                          / jnp.linalg.norm(ref))
  return row


if __name__ == "__main__":
  main()
