"""Benchmark + on-GPU check of pallas_kernels.moe.moe_block at MiniMax-M3 dims.

  PYTHONPATH=$PWD python3 scripts/bench_moe.py --out /tmp/moe_bench.json

Prefill rows: whole-block effective TFLOP/s (routed 6*T*K*H*I + shared 6*T*H*Is + router 2*T*H*E)
for the kernel and the pure-XLA reference, and the gate_up GEMM alone (2*T*K*H*2I FLOPs, rows
sorted by expert) for this kernel (fused SwiGLU), lax.ragged_dot and jax's ragged_dot_mgpu.
Decode rows: effective TB/s over the expert weights actually touched (distinct routed experts + the
shared expert, 3*H*I bf16 each). Times are wall-clock medians of back-to-back jitted calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import MoeBlockSizes, heuristic_block_sizes, moe_block, moe_block_reference
from pallas_kernels.moe.dispatch import build_dispatch
from pallas_kernels.moe.kernel_sm90 import grouped_matmul
from pallas_kernels.moe.reference import route_reference

H, I, E, IS, TOP_K = 6144, 3072, 128, 3072, 4
TINY = False  # --tiny: CPU smoke test in the GPU interpreter
KW = dict(top_k=TOP_K, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)


def num_sms() -> int:
  return getattr(jax.devices()[0], "core_count", 3) if jax.default_backend() == "gpu" else 3


def make_weights(key):
  """Random bf16 expert weights at M3 dims; router fp32 (logits ~ N(0, 1): balanced routing)."""
  ks = jax.random.split(key, 6)
  n = lambda k, shape, scale, dt=jnp.bfloat16: (jax.random.normal(k, shape, dt) * scale).astype(dt)
  return dict(
      router_w=n(ks[0], (H, E), H ** -0.5, jnp.float32),
      correction_bias=n(ks[1], (E,), 0.01, jnp.float32),
      w_gate_up=n(ks[2], (E, H, 2 * I), H ** -0.5), w_down=n(ks[3], (E, I, H), I ** -0.5),
      shared_gate_up=n(ks[4], (H, 2 * IS), H ** -0.5), shared_down=n(ks[5], (IS, H), IS ** -0.5),
  )


def block_args(x, w, bias=None):
  return (x, w["router_w"], w["correction_bias"] if bias is None else bias, w["w_gate_up"],
          w["w_down"], w["shared_gate_up"], w["shared_down"])


def timeit(f, *args, reps: int = 10, rounds: int = 5, warmup: int = 2) -> float:
  """Median seconds per call over `rounds` rounds of `reps` back-to-back calls (after warm-up); one call, no
  warm-up, under --tiny (the GPU interpreter: its times mean nothing, the call checks the code path)."""
  if TINY:
    reps, rounds, warmup = 1, 1, 0
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def rel_err(out, ref) -> tuple[float, float]:
  out = np.asarray(out.astype(jnp.float32), np.float64)
  ref = np.asarray(ref.astype(jnp.float32), np.float64)
  if not np.isfinite(out).all():
    return float("nan"), float("nan")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)), float(np.abs(out - ref).max())


def block_flops(t: int) -> float:
  return 6.0 * t * TOP_K * H * I + 6.0 * t * H * IS + 2.0 * t * H * E


def safe(results, key, fn):
  """Runs fn(); stores its value or the error under results[key]."""
  try:
    results[key] = fn()
  except Exception as e:  # noqa: BLE001 - a failing variant must not stop the sweep
    results[key] = f"ERROR {type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc()
  print(f"  {key}: {results[key]}", flush=True)
  return results[key]


def sorted_rows(x, w):
  """x rows sorted by routed expert ([T*K, H]) and int32 group sizes [E] (for the GEMM-alone rows)."""
  _, ids, _ = route_reference(x, w["router_w"], w["correction_bias"], top_k=TOP_K)
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return x[order // TOP_K], jnp.bincount(flat, length=E).astype(jnp.int32), ids


def bench_prefill(t: int, w, key, args) -> dict:
  r: dict = {"T": t}
  x = jax.random.normal(key, (t, H), jnp.bfloat16)
  a = block_args(x, w)
  if t <= args.check_max_t:
    safe(r, "check_rel_err,max_abs", lambda: rel_err(moe_block(*a, **KW), moe_block_reference(*a, **KW)))
  fl = block_flops(t)
  safe(r, "kernel_ms", lambda: 1e3 * timeit(functools.partial(moe_block, **KW), *a, reps=args.reps))
  slow = dict(reps=1, rounds=2, warmup=1)  # the XLA reference runs at ~7 TFLOP/s
  if t <= args.reference_max_t:  # lax.ragged_dot on GPU materialises [T*K, E*H]: OOM beyond ~16K tokens
    safe(r, "reference_ms", lambda: 1e3 * timeit(functools.partial(moe_block_reference, **KW), *a,
                                                 **slow))
  for k in ("kernel", "reference"):
    if isinstance(r.get(f"{k}_ms"), float):
      r[f"{k}_tflops"] = fl / (r[f"{k}_ms"] * 1e-3) / 1e12
  if args.variants and t == args.variant_t:
    alts = {
        "m-split st3": (MoeBlockSizes(block_m=128, block_n=128, max_concurrent_steps=3),
                        MoeBlockSizes(block_m=128, block_n=256, max_concurrent_steps=3)),
    }
    for tag, bs in alts.items():
      safe(r, f"variant {tag} TFLOP/s", lambda bs=bs: fl / timeit(
          functools.partial(moe_block, **KW, block_sizes=bs), *a, reps=args.reps) / 1e12)
  # gate_up GEMM alone on expert-sorted rows.
  r.update(gate_up_alone(x, w, args, with_lax=t <= args.reference_max_t // 2,
                         mgpu_cfgs=((128, 128, 64, 4, 1), (128, 128, 64, 4, 8))))
  gflops = 2.0 * t * TOP_K * H * 2 * I
  for k in list(r):
    if k.startswith("gu_") and isinstance(r[k], float):
      r[k.replace("_ms", "_tflops")] = gflops / (r[k] * 1e-3) / 1e12
  return r


def gate_up_alone(x, w, args, *, with_lax: bool, mgpu_cfgs) -> dict:
  """ms of the gate_up GEMM alone on x's routed rows: this kernel (fused SwiGLU, on the padded dispatch
  layout), lax.ragged_dot and jax's ragged_dot_mgpu (block_m, block_n, block_k, stages, grid_block_n) on the
  expert-sorted rows."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=g-import-not-at-top

  r: dict = {}
  t = x.shape[0]
  xs, gs, ids = jax.jit(sorted_rows)(x, w)
  wgu = w["w_gate_up"]
  bs_gu, _ = heuristic_block_sizes(t, TOP_K, E)
  d = build_dispatch(ids, num_experts=E, block_m=bs_gu.block_m, fuse_shared=False)
  xs_pad = jax.jit(lambda x, rt: x[rt])(x, d.row_token)
  ours = jax.jit(functools.partial(grouped_matmul, n_parts=2, epilogue="swiglu",
                                   out_dtype=jnp.bfloat16, block_sizes=bs_gu, num_sms=num_sms()))
  reps = dict(reps=args.reps * (3 if t <= 64 else 1))
  safe(r, "gu_kernel_ms", lambda: 1e3 * timeit(lambda m, l, ww: ours(m, l, ww, None), d.meta, xs_pad, wgu, **reps))
  if with_lax:
    safe(r, "gu_lax_ragged_dot_ms", lambda: 1e3 * timeit(jax.jit(jax.lax.ragged_dot), xs, wgu, gs,
                                                         **(reps if t <= 64 else dict(reps=1, rounds=2, warmup=1))))
  for cfg in mgpu_cfgs:
    bm, bn, bk, st, gbn = cfg
    f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=bm, block_n=bn, block_k=bk,
                                  max_concurrent_steps=st, grid_block_n=gbn))
    safe(r, f"gu_ragged_dot_mgpu{cfg}_ms",
         lambda f=f: 1e3 * timeit(lambda a_, b_, g_: f(a_, b_, group_sizes=g_), xs, wgu, gs, **reps))
  return r


def bench_decode(t: int, w, key, args, block_sizes=None, tag="") -> dict:
  r: dict = {"T": t, "tiles": tag or "heuristic"}
  x = jax.random.normal(key, (t, H), jnp.bfloat16)
  a = block_args(x, w)
  _, ids, _ = route_reference(x, w["router_w"], w["correction_bias"], top_k=TOP_K)
  touched = int(len(np.unique(np.asarray(ids))))
  nbytes = (touched + 1) * 3 * H * I * 2  # routed experts touched + shared expert, bf16
  r.update(touched_experts=touched, weight_gb=nbytes / 1e9)
  kw = dict(KW, block_sizes=block_sizes)
  safe(r, "check_rel_err,max_abs", lambda: rel_err(moe_block(*a, **kw), moe_block_reference(*a, **KW)))
  safe(r, "kernel_ms", lambda: 1e3 * timeit(functools.partial(moe_block, **kw), *a, reps=args.reps * 3))
  if not tag:
    safe(r, "reference_ms", lambda: 1e3 * timeit(functools.partial(moe_block_reference, **KW), *a,
                                                 reps=args.reps * 3))
    if jax.default_backend() == "gpu":  # where the time goes: CUPTI time of every launch of one call
      safe(r, "kernels_us", lambda: gpu_kernel_times(functools.partial(moe_block, **kw), *a))
  for k in ("kernel", "reference"):
    if isinstance(r.get(f"{k}_ms"), float):
      r[f"{k}_TBps"] = nbytes / (r[f"{k}_ms"] * 1e-3) / 1e12
  if not tag and args.grouped_decode:
    layouts_side_by_side(r, a, kw, args, nbytes)
  if not tag and args.decode_baselines:  # the gate_up GEMM alone: TB/s over the gate_up weights touched
    r.update(gate_up_alone(x, w, args, with_lax=True, mgpu_cfgs=((64, 128, 64, 4, 1), (128, 128, 64, 4, 1))))
    gu_bytes = touched * H * 2 * I * 2
    for k in list(r):
      if k.startswith("gu_") and isinstance(r[k], float):
        r[k.replace("_ms", "_TBps")] = gu_bytes / (r[k] * 1e-3) / 1e12
  return r


def grouped_layout_block(args_example, kw):
  """moe_block with the grouped dispatch at every T (the decode layout before the broadcast one), jitted.

  Traced once with ``api._dispatch`` patched; later calls hit the compiled cache (no patching on the hot path).
  """
  from unittest import mock  # pylint: disable=g-import-not-at-top
  import pallas_kernels.moe.api as api  # pylint: disable=g-import-not-at-top

  def grouped(expert_ids, x, *, num_experts, block_m, fuse_shared, drop_foreign=False):
    d = build_dispatch(expert_ids, num_experts=num_experts, block_m=block_m, fuse_shared=fuse_shared,
                       drop_foreign=drop_foreign)
    return d, x[d.row_token]

  jitted = jax.jit(functools.partial(api.moe_block.__wrapped__, **kw))
  with mock.patch.object(api, "_dispatch", grouped):
    jax.block_until_ready(jitted(*args_example))
  return jitted


def layouts_side_by_side(r, a, kw, args, nbytes):
  """--grouped-decode: the broadcast (default) and grouped decode layouts, timed in alternating rounds."""
  new = jax.jit(functools.partial(moe_block, **kw))
  old = grouped_layout_block(a, kw)
  safe(r, "grouped_layout_rel_diff", lambda: rel_err(new(*a), old(*a)))
  samples = {"broadcast": [], "grouped": []}
  for _ in range(5):
    for name, f in (("broadcast", new), ("grouped", old)):
      samples[name].append(1e3 * timeit(f, *a, reps=args.reps * 3, rounds=3))
  for name, v in samples.items():
    r[f"layout_{name}_ms_samples"] = [round(x, 4) for x in v]
    r[f"layout_{name}_ms"] = statistics.median(v)
    r[f"layout_{name}_TBps"] = nbytes / (r[f"layout_{name}_ms"] * 1e-3) / 1e12
  if jax.default_backend() == "gpu":
    safe(r, "grouped_kernels_us", lambda: gpu_kernel_times(old, *a))


def stacked_blocks(t: int, w, key, args, depth: int) -> dict:
  """--decode-stack: ``depth`` MoE blocks (same weights, independent token batches) in one jitted call, as a
  decode step runs its layers: per-block time without the per-call host dispatch and sync of single calls.

  TB/s counts each block's own touched experts (+ the shared expert).
  """
  xs = jax.random.normal(key, (depth, t, H), jnp.bfloat16)
  touched = 0
  for i in range(depth):
    _, ids, _ = route_reference(xs[i], w["router_w"], w["correction_bias"], top_k=TOP_K)
    touched += len(np.unique(np.asarray(ids)))
  nbytes = (touched + depth) * 3 * H * I * 2

  @jax.jit
  def stack(xs, *rest):
    return jnp.stack([moe_block(xs[i], *rest, **KW) for i in range(depth)])

  rest = block_args(xs[0], w)[1:]
  r = {"T": t, "depth": depth, "weight_gb": nbytes / 1e9}
  samples = [1e3 * timeit(stack, xs, *rest, reps=args.reps, rounds=3) / depth for _ in range(5)]
  r["per_block_ms_samples"] = [round(v, 4) for v in samples]
  r["per_block_ms"] = statistics.median(samples)
  r["TBps"] = nbytes / depth / (r["per_block_ms"] * 1e-3) / 1e12
  return r


def gpu_kernel_times(f, *args) -> list:
  """[(kernel name, us)] of one call (CUPTI, via jax's Mosaic GPU profiler) plus their sum."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

  jax.block_until_ready(f(*args))
  _, per_kernel = profiler.measure(f, aggregate=False)(*args)
  rows = [(name[:50], round(ms * 1e3, 1)) for name, ms in per_kernel]
  return rows + [("sum", round(sum(v for _, v in rows), 1))]


def edge_checks(w, key) -> dict:
  """GPU correctness at M3 dims: all tokens on the same 4 experts (rest empty), T not a tile multiple."""
  r: dict = {}
  bias = jnp.zeros((E,), jnp.float32).at[jnp.array([3, 77, 100, 127])].set(50.0)
  for t in (1, 1000):
    x = jax.random.normal(key, (t, H), jnp.bfloat16)
    a = block_args(x, w, bias)
    safe(r, f"forced4_T{t}_rel_err,max_abs", lambda a=a: rel_err(moe_block(*a, **KW),
                                                                 moe_block_reference(*a, **KW)))
  x = jax.random.normal(key, (77, H), jnp.bfloat16)
  a = block_args(x, w)
  safe(r, "unfused_shared_T77_rel_err,max_abs",
       lambda: rel_err(moe_block(*a, **KW, fuse_shared=False), moe_block_reference(*a, **KW)))
  return r


def fp32_checks() -> dict:
  """fp32 operands (bf16x3 path) at small dims vs the reference at HIGHEST matmul precision."""
  r: dict = {}
  h, inter, e = 256, 128, 8
  for t in (5, 70):
    ks = jax.random.split(jax.random.key(t), 7)
    nrm = lambda k, shape, sc: jax.random.normal(k, shape, jnp.float32) * sc
    a = (nrm(ks[0], (t, h), 1.0), nrm(ks[1], (h, e), h ** -0.5), nrm(ks[2], (e,), 0.1),
         nrm(ks[3], (e, h, 2 * inter), 3 * h ** -0.5), nrm(ks[4], (e, inter, h), inter ** -0.5),
         nrm(ks[5], (h, 2 * inter), 3 * h ** -0.5), nrm(ks[6], (inter, h), inter ** -0.5))
    kw = dict(KW, top_k=2)

    def run(a=a, kw=kw):
      with jax.default_matmul_precision("highest"):
        ref = moe_block_reference(*a, **kw)
      return rel_err(moe_block(*a, **kw), ref)
    safe(r, f"fp32_T{t}_rel_err,max_abs", run)
  return r


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--prefill", default="4096,8192,16384,32768")
  p.add_argument("--decode", default="1,8,32,64")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--check-max-t", type=int, default=8192)
  p.add_argument("--reference-max-t", type=int, default=16384,
                 help="largest prefill timed on the XLA reference (its ragged_dot needs T*K*E*H*2 bytes)")
  p.add_argument("--variants", action="store_true", help="also time alternative decode tiles")
  p.add_argument("--variant-t", type=int, default=16384, help="prefill size for --variants")
  p.add_argument("--no-edge", action="store_true")
  p.add_argument("--decode-baselines", action="store_true",
                 help="decode rows also time the gate_up GEMM alone: this kernel, lax.ragged_dot, ragged_dot_mgpu")
  p.add_argument("--grouped-decode", action="store_true",
                 help="also time the grouped dispatch layout at decode T (alternating rounds with the default)")
  p.add_argument("--decode-stack", type=int, default=0,
                 help="also time this many decode blocks inside one jitted call (per-block time)")
  p.add_argument("--fp32-check", action="store_true", help="small-dim fp32 (bf16x3) check")
  p.add_argument("--out", default=None)
  p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny dims, GPU interpreter")
  p.add_argument("--expert-width", type=int, default=None,
                 help="routed and shared expert width instead of 3072, e.g. 384 = one GPU's slice in a "
                      "tensor-parallel 8-way split")
  p.add_argument("--decode-tiles", default="",
                 help="extra decode rows with other tiles: comma-separated GATE_BN/DOWN_BN/STAGES (block_m 64 "
                      "split by columns; block_m 128 split by rows when a width is 64), e.g. 64/256/5,128/128/6")
  args = p.parse_args()
  global H, I, E, IS, TINY
  if args.tiny:
    H, I, E, IS, TINY = 256, 128, 8, 128, True
  if args.expert_width:
    I = IS = args.expert_width
  if args.tiny:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    with plgpu.force_gpu_interpret_mode():
      return run(args)
  return run(args)


def run(args):
  print(jax.devices(), flush=True)
  key = jax.random.key(0)
  w = make_weights(key)
  jax.block_until_ready(w)
  res = {"device": str(jax.devices()[0].device_kind), "dims": {"H": H, "I": I, "E": E, "IS": IS}, "edge": {},
         "prefill": [], "decode": []}

  def dump():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)

  if args.fp32_check:
    print("== fp32 check", flush=True)
    res["edge"].update(fp32_checks())
    dump()
  if not args.no_edge:
    print("== edge checks", flush=True)
    res["edge"].update(edge_checks(w, jax.random.key(7)))
    dump()
  for t in [int(v) for v in args.decode.split(",") if v]:
    print(f"== decode T={t}", flush=True)
    res["decode"].append(bench_decode(t, w, jax.random.key(t), args))
    dump()
    if args.decode_stack:
      res.setdefault("decode_stack", []).append(stacked_blocks(t, w, jax.random.key(100 + t), args,
                                                               args.decode_stack))
      dump()
    for spec in [v for v in args.decode_tiles.split(",") if v]:
      gate_bn, down_bn, stages = (int(v) for v in spec.split("/"))
      # Two warpgroups split a tile by columns only in whole 64-column halves; narrower tiles split rows.
      bm, split = (64, "n") if min(gate_bn, down_bn) >= 128 else (128, "m")
      bs = (MoeBlockSizes(block_m=bm, block_n=gate_bn, max_concurrent_steps=stages, wg_split=split),
            MoeBlockSizes(block_m=bm, block_n=down_bn, max_concurrent_steps=stages, wg_split=split))
      res["decode"].append(bench_decode(t, w, jax.random.key(t), args, bs, tag=f"bn{gate_bn}/{down_bn} st{stages}"))
      dump()
    if args.variants and t == 64:
      bs = (MoeBlockSizes(block_m=64, block_n=128, max_concurrent_steps=6, wg_split="n"),
            MoeBlockSizes(block_m=64, block_n=128, max_concurrent_steps=6, wg_split="n"))
      res["decode"].append(bench_decode(t, w, jax.random.key(t), args, bs, tag="bn128/128 st6"))
      dump()
  for t in [int(v) for v in args.prefill.split(",") if v]:
    print(f"== prefill T={t}", flush=True)
    res["prefill"].append(bench_prefill(t, w, jax.random.key(t), args))
    dump()
  print(summarize(res))


def _f(v, fmt="{:.1f}"):
  return fmt.format(v) if isinstance(v, float) else "-"


def summarize(res) -> str:
  """Markdown tables of the measured numbers."""
  lines = [f"device: {res['device']}", "", "edge checks (rel L2 err, max abs) vs reference:"]
  lines += [f"  {k}: {v}" for k, v in res["edge"].items()]
  lines += ["", "| decode T | tiles | touched experts (+shared) | GB | kernel ms | kernel TB/s | "
            "reference ms | reference TB/s | check (rel err, max abs) |", "|" + "---|" * 9]
  for r in res["decode"]:
    lines.append(
        f"| {r['T']} | {r['tiles']} | {r['touched_experts']}+1 | {r['weight_gb']:.2f} | "
        f"{_f(r.get('kernel_ms'), '{:.3f}')} | {_f(r.get('kernel_TBps'), '{:.2f}')} | "
        f"{_f(r.get('reference_ms'), '{:.3f}')} | {_f(r.get('reference_TBps'), '{:.2f}')} | "
        f"{r.get('check_rel_err,max_abs', '-')} |")
  lines += ["", "| prefill T | block kernel ms | block kernel TFLOP/s | block reference ms | "
            "block reference TFLOP/s | gate_up: kernel (fused act) | lax.ragged_dot | ragged_dot_mgpu "
            "(best cfg) | check (rel err, max abs) |", "|" + "---|" * 9]
  for r in res["prefill"]:
    mg = [v for k, v in r.items() if k.startswith("gu_ragged_dot_mgpu") and k.endswith("_tflops")]
    lines.append(
        f"| {r['T']} | {_f(r.get('kernel_ms'))} | {_f(r.get('kernel_tflops'))} | "
        f"{_f(r.get('reference_ms'))} | {_f(r.get('reference_tflops'))} | "
        f"{_f(r.get('gu_kernel_tflops'))} | {_f(r.get('gu_lax_ragged_dot_tflops'))} | "
        f"{_f(max(mg) if mg else None)} | {r.get('check_rel_err,max_abs', '-')} |")
  for r in res["prefill"]:
    lines += [f"  T={r['T']} {k}: {_f(v)}" for k, v in r.items() if k.startswith("variant")]
  for r in res.get("decode_stack", []):
    lines.append(f"  decode T={r['T']}, {r['depth']} blocks in one call: {r['per_block_ms']:.4f} ms per block, "
                 f"{r['TBps']:.2f} TB/s (samples {r['per_block_ms_samples']})")
  for r in res["decode"]:  # --grouped-decode
    if "layout_grouped_TBps" in r:
      lines.append(f"  decode T={r['T']} layouts (median of 5 alternating rounds): broadcast "
                   f"{r['layout_broadcast_ms']:.4f} ms {r['layout_broadcast_TBps']:.2f} TB/s, grouped "
                   f"{r['layout_grouped_ms']:.4f} ms {r['layout_grouped_TBps']:.2f} TB/s")
  for r in res["decode"]:  # --decode-baselines: gate_up alone, TB/s over the gate_up weights touched
    lines += [f"  decode T={r['T']} {k}: {_f(v, '{:.2f}')}" for k, v in r.items() if k.endswith("_TBps")
              and k.startswith("gu_")]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
