"""How fast the attention inner loop runs with 16-row tiles (mma.sync) against 64-row tiles (wgmma) on Hopper.

The sparse prefill kernel (pallas_kernels/attention/kernel_sm90_ws.py) spends a 64-row wgmma (4 queries x 16
heads) on every block any of a warpgroup's 4 queries selected. On the benchmark's indexer selections 45 %
(correlated) to 80 % (random) of those blocks are used by a single query, so 3/4 of their rows are masked.
A 16-row tile (one query's 16 heads) has no such waste, but Hopper's wgmma needs M = 64. Two ways around it:
the Ampere-style mma.sync (`plgpu.mma`), whose operands come from registers loaded out of shared memory, or
a transposed wgmma with the keys on M and the 16 heads on N (N may be as small as 8). This script times the
inner loops with K and V resident in shared memory (no HBM traffic), so each rate is an upper bound on what
a kernel built on it could reach:

  wgmma64:   S = Q[64, 128] K^T (wgmma), base-2 online softmax, O += P V (wgmma, P from registers)
  mma16:     the same for Q[16, 128] with plgpu.mma (K^T and V loaded from shared memory every step,
             P converted through shared memory to the operand layout)
  wgmmaT16:  S^T = K Q^T [128, 16] (wgmma), softmax over the keys (axis 0, across warps),
             O^T += V^T P^T (wgmma, P stored transposed to shared memory)
  wgmmaT16r: the same with V^T loaded into registers (P^T stored untransposed)
  wgmmaT32r: wgmmaT16r with two independent (query, block) chains per warpgroup
  wgmmaT16f: diagnostic, wgmmaT16r without the running max (valid only for these O(1) scores)

  PYTHONPATH=$PWD JAX_PLATFORMS=cuda python3 scripts/bench_row_tile.py [--out DIR] [--kinds K1,K2]

A singleton block costs a 64-row step on the current kernel and one 16-row step on either path, so a path
pays off for singletons only if its rate is well above rate(wgmma64) / 4; the printed `<kind>_singleton_cost`
is time(16-row step) / time(64-row step). Each result is checked against numpy. GPU only: the Mosaic GPU
interpreter has no rule for plgpu.mma, and none for wgmma with warpgroup threads (num_threads).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_common import gpu_ms  # noqa: E402

from pallas_kernels.attention.kernel_sm90 import LOG2E  # noqa: E402

D = 128
KEYS = 128
# rows (query heads) per warpgroup step of each kind
ROWS = {"wgmma64": 64, "mma16": 16, "wgmmaT16": 16, "wgmmaT16r": 16, "wgmmaT16f": 16, "wgmmaT32r": 32}
DTYPE = jnp.bfloat16
TOLERANCE = 1e-2  # max |error| of the bf16 kernels against numpy (values are O(1)); above it a row is wrong


def _swizzled():
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _softmax_step(s, m_i, l_i, acc, scale):
  """One base-2 online-softmax update: (p [R, KEYS] fp32, m_new, l_new, acc rescaled)."""
  c = scale * LOG2E
  m_new = jnp.maximum(m_i, s.max(axis=1) * c)
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
  l_new = l_i * alpha + p.sum(axis=1)
  return p, m_new, l_new, acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def _load_shared_block(wg, k_ref, v_ref, k_smem, v_smem, kv_barrier):
  """Warpgroup 0 copies the K and V block once; every warpgroup waits for it."""

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(k_ref, k_smem, kv_barrier)
    plgpu.copy_gmem_to_smem(v_ref, v_smem, kv_barrier)

  plgpu.barrier_wait(kv_barrier)


def wgmma64_kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, barrier, kv_barrier, *, steps, scale):
  """q_ref [C, W, 64, D]; k_ref, v_ref [KEYS, D]; o_ref [C, W, 64, D] (fp32 normalised output)."""
  cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
  plgpu.copy_gmem_to_smem(q_ref.at[cta, wg], q_smem.at[wg], barrier.at[wg])
  plgpu.barrier_wait(barrier.at[wg])
  _load_shared_block(wg, k_ref, v_ref, k_smem, v_smem, kv_barrier)
  row = plgpu.Layout.WGMMA.reduce(1)
  init = (
      plgpu.layout_cast(jnp.zeros((64, D), jnp.float32), plgpu.Layout.WGMMA),
      plgpu.layout_cast(jnp.full((64,), -jnp.inf, jnp.float32), row),
      plgpu.layout_cast(jnp.zeros((64,), jnp.float32), row),
  )

  def step(_, carry):
    acc, m_i, l_i = carry

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((64, KEYS), jnp.float32))
    p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, scale)
    p16 = p.astype(DTYPE)
    acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem))(plgpu.ACC.init(acc))
    return acc, m_i, l_i

  acc, _, l_i = lax.fori_loop(0, steps, step, init)
  o_ref.at[cta, wg][...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])


def mma16_kernel(q_ref, k_ref, vt_ref, o_ref, k_smem, vt_smem, p_smem, kv_barrier, *, steps, scale, optimized):
  """q_ref [C, W, 16, D]; k_ref [KEYS, D]; vt_ref [D, KEYS] (V transposed: the mma B operand must be
  contiguous along its contraction axis); o_ref [C, W, 16, D] (fp32 normalised output)."""
  cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
  _load_shared_block(wg, k_ref, vt_ref, k_smem, vt_smem, kv_barrier)
  acc_layout = plgpu.Layout.MMA_ACC(DTYPE, m_warps=1)
  row = acc_layout.reduce(1)
  q = plgpu.load(q_ref.at[cta, wg], layout=plgpu.Layout.MMA_LHS(DTYPE, m_warps=1), optimized=False)
  init = (
      plgpu.layout_cast(jnp.zeros((16, D), jnp.float32), acc_layout),
      plgpu.layout_cast(jnp.full((16,), -jnp.inf, jnp.float32), row),
      plgpu.layout_cast(jnp.zeros((16,), jnp.float32), row),
  )
  rhs = plgpu.Layout.MMA_RHS(DTYPE, m_warps=1)

  def step(_, carry):
    acc, m_i, l_i = carry
    k_t = plgpu.load(k_smem.T, layout=rhs, optimized=optimized)
    s = plgpu.mma(plgpu.layout_cast(jnp.zeros((16, KEYS), jnp.float32), acc_layout), q, k_t)
    p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, scale)
    plgpu.commit_smem()  # a warpgroup barrier: every warp has read the previous step's P
    p_smem.at[wg][...] = p.astype(DTYPE)
    plgpu.commit_smem()  # and this step's P is written before any warp reads it
    p16 = plgpu.load(p_smem.at[wg], layout=plgpu.Layout.MMA_LHS(DTYPE, m_warps=1), optimized=optimized)
    v = plgpu.load(vt_smem.T, layout=rhs, optimized=optimized)
    return plgpu.mma(acc, p16, v), m_i, l_i

  acc, _, l_i = lax.fori_loop(0, steps, step, init)
  o_ref.at[cta, wg][...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])


def wgmma_t16_kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, p_smem, barrier, kv_barrier, *, steps,
                     scale, deferred_sum, v_in_registers, fixed_max, pairs):
  """Transposed 16-row steps: S^T [KEYS, 16] = K Q^T and O^T [D, 16] += V^T P^T, so the 16 heads of one query
  are wgmma's N (which may be as small as 8) and the keys its M. The softmax reduces over axis 0 (across the
  warps of the warpgroup). Each warpgroup runs `pairs` independent (query, block) chains per step, their
  wgmmas issued together. q_ref [C, W, pairs * 16, D]; o_ref [C, W, pairs, D, 16] (fp32 normalised output,
  transposed). deferred_sum keeps the softmax denominator as per-element partial sums, reduced once at the end.
  fixed_max (diagnostic only, wgmmaT16f): no running max, to time what the cross-warp max costs.
  v_in_registers: P.V takes V^T from registers (wgmma's A operand from shared memory must share B's swizzle,
  and P^T [KEYS, 16] only allows a 32-byte one); otherwise P is stored transposed to match V's swizzle."""
  cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
  plgpu.copy_gmem_to_smem(q_ref.at[cta, wg], q_smem.at[wg], barrier.at[wg])
  plgpu.barrier_wait(barrier.at[wg])
  _load_shared_block(wg, k_ref, v_ref, k_smem, v_smem, kv_barrier)
  c = scale * LOG2E
  one = (
      plgpu.layout_cast(jnp.zeros((D, 16), jnp.float32), plgpu.Layout.WGMMA),
      jnp.full((16,), -jnp.inf, jnp.float32),
      plgpu.layout_cast(jnp.zeros((KEYS, 16), jnp.float32), plgpu.Layout.WGMMA) if deferred_sum
      else jnp.zeros((16,), jnp.float32),
  )
  q_t = [q_smem.at[wg, pl.ds(16 * j, 16)].transpose((1, 0)) for j in range(pairs)]

  def softmax(s, m_i, l_i, acc):
    if fixed_max:  # diagnostic: no running max (exact here only because these scores are O(1))
      p = jnp.exp2(s * c)
      return p, m_i, l_i + (p if deferred_sum else p.sum(axis=0)), acc
    m_new = jnp.maximum(m_i, s.max(axis=0) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [1]))
    if deferred_sum:
      l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [1]) + p
    else:
      l_i = l_i * alpha + p.sum(axis=0)
    return p, m_new, l_i, acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

  def step(_, carry):
    def qk(*acc_refs):
      for j, acc_ref in enumerate(acc_refs):
        plgpu.wgmma(acc_ref, k_smem, q_t[j])
      return tuple(acc_ref[...] for acc_ref in acc_refs)

    scores = pl.run_scoped(qk, *[plgpu.ACC((KEYS, 16), jnp.float32)] * pairs)
    new, operands = [], []
    for j, (s, (acc, m_i, l_i)) in enumerate(zip(scores, carry)):
      p, m_i, l_i, acc = softmax(s, m_i, l_i, acc)
      new.append((acc, m_i, l_i))
      if v_in_registers:  # B = P^T [KEYS, 16] (N-major)
        p_smem.at[wg, j][...] = p.astype(DTYPE)
        operands.append(p_smem.at[wg, j])
      else:  # P stored transposed, [16, KEYS] (K-major), to share V's swizzle
        p_smem.at[wg, j].transpose((1, 0))[...] = p.astype(DTYPE)
        operands.append(p_smem.at[wg, j].transpose((1, 0)))
    plgpu.commit_smem()
    v_t = (plgpu.load(v_smem.transpose((1, 0)), layout=plgpu.Layout.WGMMA) if v_in_registers
           else v_smem.transpose((1, 0)))

    def pv(*acc_refs):  # fresh accumulators, added to the rescaled ones in registers
      for acc_ref, b in zip(acc_refs, operands):
        plgpu.wgmma(acc_ref, v_t, b)
      return tuple(acc_ref[...] for acc_ref in acc_refs)

    pvs = pl.run_scoped(pv, *[plgpu.ACC((D, 16), jnp.float32)] * pairs)
    return tuple((acc + pv_j, m_i, l_i) for pv_j, (acc, m_i, l_i) in zip(pvs, new))

  final = lax.fori_loop(0, steps, step, (one,) * pairs)
  for j, (acc, _, l_i) in enumerate(final):
    if deferred_sum:
      l_i = l_i.sum(axis=0)
    o_ref.at[cta, wg, j][...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [1])


def build(kind: str, *, ctas: int, wgs: int, steps: int, optimized: bool = True):
  """A jitted fn(q, k, v) -> o [ctas, wgs, ROWS[kind], D] for a kind of ROWS. `optimized`: optimized
  shared-memory loads (mma16) or the per-element softmax denominator (wgmmaT*)."""
  scale = D ** -0.5
  out_type = jax.ShapeDtypeStruct((ctas, wgs, ROWS[kind], D), jnp.float32)
  common = dict(
      grid=(ctas,), grid_names=("cta",), num_threads=wgs, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )
  if kind == "wgmma64":
    kernel = plgpu.kernel(
        functools.partial(wgmma64_kernel, steps=steps, scale=scale),
        scratch_types=[
            plgpu.SMEM((wgs, 64, D), DTYPE, transforms=_swizzled()),
            plgpu.SMEM((KEYS, D), DTYPE, transforms=_swizzled()),
            plgpu.SMEM((KEYS, D), DTYPE, transforms=_swizzled()),
            plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
            plgpu.Barrier(num_arrivals=2),
        ],
        out_type=out_type,
        **common,
    )
    return jax.jit(kernel)
  if kind.startswith("wgmmaT"):  # the output comes back transposed, [..., pairs, D, 16]
    v_in_registers = kind != "wgmmaT16"
    pairs = ROWS[kind] // 16
    p_smem = (plgpu.SMEM((wgs, pairs, KEYS, 16), DTYPE,
                         transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))
              if v_in_registers else plgpu.SMEM((wgs, pairs, 16, KEYS), DTYPE, transforms=_swizzled()))
    kernel = plgpu.kernel(
        functools.partial(wgmma_t16_kernel, steps=steps, scale=scale, deferred_sum=optimized,
                          v_in_registers=v_in_registers, fixed_max=kind == "wgmmaT16f", pairs=pairs),
        out_type=jax.ShapeDtypeStruct((ctas, wgs, pairs, D, 16), jnp.float32),
        scratch_types=[
            plgpu.SMEM((wgs, pairs * 16, D), DTYPE, transforms=_swizzled()),
            plgpu.SMEM((KEYS, D), DTYPE, transforms=_swizzled()),
            plgpu.SMEM((KEYS, D), DTYPE, transforms=_swizzled()),
            p_smem,
            plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
            plgpu.Barrier(num_arrivals=2),
        ],
        **common,
    )
    return jax.jit(lambda q, k, v: kernel(q, k, v).swapaxes(-1, -2).reshape(ctas, wgs, pairs * 16, D))
  kernel = plgpu.kernel(
      functools.partial(mma16_kernel, steps=steps, scale=scale, optimized=optimized),
      scratch_types=[
          plgpu.SMEM((KEYS, D), DTYPE),
          plgpu.SMEM((D, KEYS), DTYPE),
          plgpu.SMEM((wgs, 16, KEYS), DTYPE),
          plgpu.Barrier(num_arrivals=2),
      ],
      out_type=out_type,
      **common,
  )
  return jax.jit(lambda q, k, v: kernel(q, k, v.T))


def reference(q, k, v):
  """The loop's result in numpy: every step attends to the same block, so O = softmax(q k^T) v."""
  s = np.einsum("cwrd,kd->cwrk", np.float32(q), np.float32(k)) * D ** -0.5
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("cwrk,kd->cwrd", p / p.sum(-1, keepdims=True), np.float32(v))


def inputs(ctas, wgs, rows, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (ctas, wgs, rows, D), DTYPE)
  k = jax.random.normal(kk, (KEYS, D), DTYPE)
  v = jax.random.normal(kv, (KEYS, D), DTYPE)
  return q, k, v


def run_case(kind, *, ctas, wgs, steps, optimized=True):
  q, k, v = inputs(ctas, wgs, ROWS[kind])
  fn = build(kind, ctas=ctas, wgs=wgs, steps=steps, optimized=optimized)
  out, ms, _ = gpu_ms(fn, q, k, v, iters=10)
  err = float(np.abs(np.asarray(out) - reference(q, k, v)).max())
  flops = 4 * ROWS[kind] * KEYS * D * steps * wgs * ctas
  return {"kind": kind, "wgs": wgs, "optimized": optimized, "ctas": ctas, "steps": steps, "ms": round(ms, 4),
          "tflops": round(flops / ms / 1e9, 1), "max_abs_err": err,
          "correct": err < TOLERANCE}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  ap.add_argument("--steps", type=int, default=2048)
  ap.add_argument("--kinds", default="", help="comma-separated subset of " + ",".join(ROWS))
  args = ap.parse_args()
  sms = jax.devices()[0].core_count
  results = []
  # mma16 with 2 warpgroups per CTA is wrong (Pallas gives every warpgroup of a CTA the same scratch for
  # cross-warp reductions, and the 16-row softmax reduces across the 4 warps): timed as an upper bound only.
  cases = [("wgmma64", 2, True), ("wgmma64", 1, True), ("mma16", 1, True), ("mma16", 1, False), ("mma16", 2, True),
           ("wgmmaT16", 1, True), ("wgmmaT16", 1, False), ("wgmmaT16r", 1, True), ("wgmmaT16r", 1, False),
           ("wgmmaT16f", 1, True), ("wgmmaT32r", 1, True)]
  for kind, wgs, opt in cases:
    if args.kinds and kind not in args.kinds.split(","):
      continue
    try:
      row = run_case(kind, ctas=sms * 4, wgs=wgs, steps=args.steps, optimized=opt)
    except Exception as e:  # noqa: BLE001 - a layout this JAX cannot lower is a result too
      row = {"kind": kind, "wgs": wgs, "optimized": opt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    results.append(row)
    print(json.dumps(row), flush=True)
  correct = [r for r in results if r.get("correct")]
  best = {k: max((r["tflops"] for r in correct if r["kind"] == k), default=None) for k in ROWS}
  if best["wgmma64"]:
    # A 16-row step does 1/4 of a 64-row step's FLOPs: its time relative to a 64-row step.
    summary = {f"{k}_tflops": v for k, v in best.items()}
    for k in ROWS:
      if best[k] and k != "wgmma64":
        summary[f"{k}_singleton_cost"] = round(best["wgmma64"] / best[k] / 4, 3)
    print(json.dumps(summary), flush=True)
    results.append(summary)
  if args.out:
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.out) / "row_tile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
