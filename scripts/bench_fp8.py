"""fp8 (MXFP8) kernels at MiniMax-M3 dims beside the bf16 kernels, in one run (issue #47's benchmark rows).

  PYTHONPATH=$PWD python3 scripts/bench_fp8.py --out /tmp/fp8.json

Rows:
  * copy: device-to-device copy bandwidth (bytes read + written), the decode roofline of this card;
  * MoE decode T = 1, 8, 32, 64: the MXFP8 block (``moe_block`` with QuantizedWeight experts) and the bf16 block
    on the same (dequantized) weights: TB/s over the weight bytes each reads (touched experts + shared; fp8
    values + E8M0 scales, or bf16), tokens/s and the fp8 / bf16 speed-up;
  * MoE prefill: effective TFLOP/s (6*T*K*H*I + 6*T*H*Is + 2*T*H*E) of both blocks;
  * dense decode projections (q / k / v / o, dense MLP gate_up / down) at T = 1..64: ``quantized_matmul``
    TB/s over the fp8 bytes + scales, beside XLA's bf16 dot on the dequantized weight.
Each timed row also checks the fp8 result against the bf16 one (rel L2). Times: median over 5 alternating rounds
(fp8, bf16, fp8, ...) of back-to-back jitted calls (``bench_moe.timeit``), after ~150 ms of device copies (rows are
timed right after host-side compilation, when the GPU has dropped to idle clocks); ``--cupti`` adds the summed
kernel time of one call (launch gaps excluded).

Weights are random: e4m3 values of a normal(0, 64) draw and E8M0 codes in [112, 118] (weights ~1e-2), made on
the device (no host quantization of 7 GB).

``--weights nvfp4`` runs the MoE rows with NVFP4 experts instead (the W4A16 kernel: random packed bytes, e4m3
group scales in [2, 6), a global multiplier of 2^-9 per part, weights ~1e-2; "fp8" in the row names then means
the quantized weights), beside the bf16 block on the same dequantized weights; the dense rows are MXFP8 only
(there is no NVFP4 dense kernel) and are skipped:

  PYTHONPATH=$PWD python3 scripts/bench_fp8.py --weights nvfp4 --dense '' --out /tmp/nvfp4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_moe import rel_err, timeit  # noqa: E402

from pallas_kernels.linear import heuristic_linear_tiles, quantized_matmul  # noqa: E402
from pallas_kernels.moe import moe_block  # noqa: E402
from pallas_kernels.moe.fp8 import heuristic_fp8_tiles  # noqa: E402
from pallas_kernels.moe.reference import route_reference  # noqa: E402
from pallas_kernels.quant import QuantizedWeight, dequantize  # noqa: E402

H, I, E, IS, TOP_K = 6144, 3072, 128, 3072, 4
KW = dict(top_k=TOP_K, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
WEIGHTS = "mxfp8"  # --weights: the MoE rows' expert format
DENSE = {"q": (8192, 6144), "k": (512, 6144), "v": (512, 6144), "o": (6144, 8192), "mlp_gate_up": (24576, 6144),
         "mlp_down": (6144, 12288)}


def random_mxfp8(key, shape) -> QuantizedWeight:
  """Random MXFP8 weight [..., out, in] made on the device."""
  kv, ks = jax.random.split(key)
  values = (jax.random.normal(kv, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)
  codes = jax.random.randint(ks, (*shape[:-1], shape[-1] // 32), 112, 119).astype(jnp.uint8)
  return QuantizedWeight(values, codes, "mxfp8", (1, 32))


def random_nvfp4(key, shape, parts: int = 1) -> QuantizedWeight:
  """Random NVFP4 weight [..., out, in] made on the device: packed bytes [..., out, in/2], e4m3 scales in [2, 6)
  [..., out, in/16], global multipliers 2^-9 [..., parts]."""
  kv, ks = jax.random.split(key)
  packed = jax.random.randint(kv, (*shape[:-1], shape[-1] // 2), 0, 256).astype(jnp.uint8)
  scales = jax.random.uniform(ks, (*shape[:-1], shape[-1] // 16), jnp.float32, 2.0, 6.0).astype(jnp.float8_e4m3fn)
  return QuantizedWeight(packed, scales, "nvfp4", (1, 16), jnp.full((*shape[:-2], parts), 2.0 ** -9, jnp.float32))


def random_weight(key, shape, parts: int = 1) -> QuantizedWeight:
  """A random weight in ``--weights``' format (mxfp8 or nvfp4; ``parts``: nvfp4 global scales per row part)."""
  return random_nvfp4(key, shape, parts) if WEIGHTS == "nvfp4" else random_mxfp8(key, shape)


def fp8_bytes(*ws: QuantizedWeight) -> int:
  """Bytes a quantized weight stores: values + scales (+ nvfp4 global scales)."""
  return sum(w.values.size + w.scales.size * w.scales.dtype.itemsize
             + (0 if w.global_scale is None else w.global_scale.size * 4) for w in ws)


def copy_bandwidth() -> dict:
  """Device copy of 4 GiB (read + write counted), median of back-to-back calls."""
  x = jnp.ones((1 << 31,), jnp.bfloat16)
  f = jax.jit(lambda a: a + jnp.bfloat16(1))
  ms = 1e3 * timeit(f, x, reps=5)
  del x
  return {"copy_ms": ms, "copy_TBps": 2 * (1 << 32) / (ms * 1e-3) / 1e12}


_SPIN = {}


def spin(ms: float = 150.0) -> None:
  """Keeps the GPU busy for ~ms (device copies) so that a row timed right after host-side compilation starts at
  working clocks, not idle ones."""
  if jax.default_backend() != "gpu":
    return
  if "f" not in _SPIN:
    _SPIN["x"] = jnp.ones((1 << 28,), jnp.bfloat16)
    _SPIN["f"] = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
  t0 = time.perf_counter()
  while (time.perf_counter() - t0) * 1e3 < ms:
    jax.block_until_ready(_SPIN["f"](_SPIN["x"]))


def alternating(fa, aa, fb, ab, *, reps: int, rounds: int = 5) -> tuple[float, float]:
  """Median ms of fa(*aa) and fb(*ab), timed in alternating rounds (after a GPU spin), so clock drift hits both.
  One round of one call each under --tiny (the GPU interpreter: its times mean nothing, as in bench_moe.timeit;
  the rows have called both already, for their correctness check)."""
  import bench_moe  # pylint: disable=g-import-not-at-top

  if bench_moe.TINY:
    rounds = 1
  else:
    jax.block_until_ready(fa(*aa)), jax.block_until_ready(fb(*ab))  # compiled before the spin
    spin()
  sa, sb = [], []
  for _ in range(rounds):
    sa.append(1e3 * timeit(fa, *aa, reps=reps, rounds=1, warmup=1))
    sb.append(1e3 * timeit(fb, *ab, reps=reps, rounds=1, warmup=1))
  return float(np.median(sa)), float(np.median(sb))


def cupti_us(f, *args) -> float:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(f(*args))
  _, per_kernel = profiler.measure(f, aggregate=False)(*args)
  return round(sum(ms for _, ms in per_kernel) * 1e3, 1)


def make_moe_weights(key):
  """MXFP8 experts in the checkpoint orientation and the same weights dequantized into the bf16 layout."""
  ks = jax.random.split(key, 6)
  n = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale
  q = dict(router_w=n(ks[0], (H, E), H ** -0.5), correction_bias=n(ks[1], (E,), 0.01),
           w_gate_up=random_weight(ks[2], (E, 2 * I, H), 2), w_down=random_weight(ks[3], (E, H, I)),
           shared_gate_up=random_weight(ks[4], (2 * IS, H), 2), shared_down=random_weight(ks[5], (H, IS)))
  to_bf16 = jax.jit(lambda w: jnp.swapaxes(dequantize(w, jnp.bfloat16), -1, -2))
  b = dict(q, **{k: to_bf16(q[k]) for k in ("w_gate_up", "w_down", "shared_gate_up", "shared_down")})
  return q, b


def block_args(x, w):
  return (x, w["router_w"], w["correction_bias"], w["w_gate_up"], w["w_down"], w["shared_gate_up"],
          w["shared_down"])


def bench_moe_decode(t, q, b, args) -> dict:
  x = jax.random.normal(jax.random.key(t), (t, H), jnp.bfloat16)
  _, ids, _ = route_reference(x, q["router_w"], q["correction_bias"], top_k=TOP_K)
  touched = len(np.unique(np.asarray(ids)))
  per_expert = [q["w_gate_up"], q["w_down"]]
  fp8_expert = sum(fp8_bytes(w) for w in per_expert) // E
  fp8_total = touched * fp8_expert + fp8_bytes(q["shared_gate_up"], q["shared_down"])
  bf16_total = (touched + 1) * 3 * H * I * 2
  r = {"T": t, "touched": touched, "fp8_GB": fp8_total / 1e9, "bf16_GB": bf16_total / 1e9,
       "tiles": str(heuristic_fp8_tiles(t, H, I, WEIGHTS))}
  f8 = jax.jit(functools.partial(moe_block, **KW))
  bf = jax.jit(functools.partial(moe_block, **KW))
  aq, ab = block_args(x, q), block_args(x, b)
  r["rel_err_fp8_vs_bf16"] = rel_err(f8(*aq), bf(*ab))[0]
  r["fp8_ms"], r["bf16_ms"] = alternating(f8, aq, bf, ab, reps=args.reps * 3)
  r["fp8_TBps"] = fp8_total / (r["fp8_ms"] * 1e-3) / 1e12
  r["bf16_TBps"] = bf16_total / (r["bf16_ms"] * 1e-3) / 1e12
  r["fp8_tok_s"], r["bf16_tok_s"] = t / (r["fp8_ms"] * 1e-3), t / (r["bf16_ms"] * 1e-3)
  r["speedup"] = r["bf16_ms"] / r["fp8_ms"]
  if args.cupti:
    r["fp8_cupti_us"], r["bf16_cupti_us"] = cupti_us(f8, *aq), cupti_us(bf, *ab)
  if args.variants:
    variant_rows(r, aq, t, fp8_total, args, reps=args.reps * 3, unit="TBps")
  return r


def variant_rows(r, aq, t, amount, args, *, reps, unit):
  """--variants: other (gate_up, down) tiles of the fp8 block, timed in the same process."""
  from pallas_kernels.moe.kernel_sm90_fp8 import Fp8Tiles  # pylint: disable=g-import-not-at-top
  gu, dn = heuristic_fp8_tiles(t, H, I, WEIGHTS)
  alts = {
      "stages-2": (dataclasses.replace(gu, max_concurrent_steps=max(2, gu.max_concurrent_steps - 2)),
                   dataclasses.replace(dn, max_concurrent_steps=max(2, dn.max_concurrent_steps - 2))),
      "down-128": (gu, dataclasses.replace(dn, row_tiles=1)),
  }
  if t > 64:
    alts["bm64"] = (Fp8Tiles(block_m=64, max_concurrent_steps=3), Fp8Tiles(block_m=64, max_concurrent_steps=4,
                                                                           row_tiles=2))
  for tag, tiles in alts.items():
    try:
      f = jax.jit(functools.partial(moe_block, **KW, block_sizes=tiles))
      jax.block_until_ready(f(*aq))
      spin()
      ms = 1e3 * timeit(f, *aq, reps=reps)
      r[f"variant {tag} ms"] = ms
      r[f"variant {tag} {unit}"] = amount / (ms * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001
      r[f"variant {tag}"] = f"{type(e).__name__}: {str(e)[:200]}"


def bench_moe_prefill(t, q, b, args) -> dict:
  x = jax.random.normal(jax.random.key(t), (t, H), jnp.bfloat16)
  flops = 6.0 * t * TOP_K * H * I + 6.0 * t * H * IS + 2.0 * t * H * E
  f8 = jax.jit(functools.partial(moe_block, **KW))
  bf = jax.jit(functools.partial(moe_block, **KW))
  aq, ab = block_args(x, q), block_args(x, b)
  r = {"T": t, "tiles": str(heuristic_fp8_tiles(t, H, I, WEIGHTS))}
  r["rel_err_fp8_vs_bf16"] = rel_err(f8(*aq), bf(*ab))[0]
  r["fp8_ms"], r["bf16_ms"] = alternating(f8, aq, bf, ab, reps=args.reps)
  r["fp8_TFLOPs"] = flops / (r["fp8_ms"] * 1e-3) / 1e12
  r["bf16_TFLOPs"] = flops / (r["bf16_ms"] * 1e-3) / 1e12
  if args.cupti:
    r["fp8_cupti_us"], r["bf16_cupti_us"] = cupti_us(f8, *aq), cupti_us(bf, *ab)
  if args.variants:
    variant_rows(r, aq, t, flops, args, reps=args.reps, unit="TFLOPs")
  return r


def bench_dense(name, t, args) -> dict:
  out_f, in_f = DENSE[name]
  w = random_mxfp8(jax.random.key(hash(name) % 1000), (out_f, in_f))
  w_bf16 = jax.jit(lambda w: dequantize(w, jnp.bfloat16))(w)
  x = jax.random.normal(jax.random.key(t), (t, in_f), jnp.bfloat16)
  f8 = jax.jit(quantized_matmul)
  bf = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  sms = getattr(jax.devices()[0], "core_count", 3) if jax.default_backend() == "gpu" else 3
  r = {"proj": name, "T": t, "tiles": str(heuristic_linear_tiles(t, out_f, in_f, "mxfp8", sms))}
  r["rel_err"] = rel_err(f8(x, w), bf(x, w_bf16))[0]
  r["fp8_ms"], r["bf16_xla_ms"] = alternating(f8, (x, w), bf, (x, w_bf16), reps=args.reps * 3)
  r["fp8_TBps"] = fp8_bytes(w) / (r["fp8_ms"] * 1e-3) / 1e12
  r["bf16_xla_TBps"] = 2 * out_f * in_f / (r["bf16_xla_ms"] * 1e-3) / 1e12
  if args.cupti:
    r["fp8_cupti_us"] = cupti_us(f8, x, w)
  return r


def summarize(res) -> str:
  f = lambda v, p=2: f"{v:.{p}f}" if isinstance(v, float) else str(v)
  lines = [f"device: {res['device']}; copy {f(res['copy'].get('copy_TBps'))} TB/s", "",
           "| MoE decode T | touched+shared | fp8 GB | fp8 ms | fp8 TB/s | bf16 ms | bf16 TB/s | tok/s fp8 | "
           "tok/s bf16 | speed-up | rel err |", "|" + "---|" * 11]
  for r in res["moe_decode"]:
    lines.append(f"| {r['T']} | {r['touched']}+1 | {f(r['fp8_GB'])} | {f(r.get('fp8_ms'), 3)} | "
                 f"{f(r.get('fp8_TBps'))} | {f(r.get('bf16_ms'), 3)} | {f(r.get('bf16_TBps'))} | "
                 f"{f(r.get('fp8_tok_s'), 0)} | {f(r.get('bf16_tok_s'), 0)} | {f(r.get('speedup'))} | "
                 f"{f(r.get('rel_err_fp8_vs_bf16'), 5)} |")
  lines += ["", "| MoE prefill T | fp8 ms | fp8 TFLOP/s | bf16 ms | bf16 TFLOP/s | rel err |", "|" + "---|" * 6]
  for r in res["moe_prefill"]:
    lines.append(f"| {r['T']} | {f(r.get('fp8_ms'))} | {f(r.get('fp8_TFLOPs'), 1)} | {f(r.get('bf16_ms'))} | "
                 f"{f(r.get('bf16_TFLOPs'), 1)} | {f(r.get('rel_err_fp8_vs_bf16'), 5)} |")
  lines += ["", "| dense | T | fp8 ms | fp8 TB/s | bf16 XLA ms | bf16 XLA TB/s | rel err | tiles |",
            "|" + "---|" * 8]
  for r in res["dense"]:
    lines.append(f"| {r['proj']} | {r['T']} | {f(r.get('fp8_ms'), 4)} | {f(r.get('fp8_TBps'))} | "
                 f"{f(r.get('bf16_xla_ms'), 4)} | {f(r.get('bf16_xla_TBps'))} | {f(r.get('rel_err'), 5)} | "
                 f"{r['tiles']} |")
  return "\n".join(lines)


def safe(fn, *a):
  try:
    return fn(*a)
  except Exception as e:  # noqa: BLE001 - one failing row must not stop the run
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--decode", default="1,8,32,64")
  p.add_argument("--prefill", default="8192")
  p.add_argument("--dense", default="q,k,o,mlp_gate_up,mlp_down")
  p.add_argument("--dense-tokens", default="1,8,64")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--cupti", action="store_true")
  p.add_argument("--variants", action="store_true", help="MoE rows also time other fp8 tiles")
  p.add_argument("--out", default=None)
  p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny dims, the GPU interpreter")
  p.add_argument("--weights", choices=("mxfp8", "nvfp4"), default="mxfp8",
                 help="the MoE rows' expert format (nvfp4: the W4A16 kernel; dense rows stay mxfp8)")
  args = p.parse_args()
  global WEIGHTS
  WEIGHTS = args.weights
  if WEIGHTS == "nvfp4" and args.dense:
    p.error("--weights nvfp4 has no dense rows (no NVFP4 dense kernel): pass --dense ''")
  if args.tiny:
    global H, I, E, IS, DENSE
    H, I, E, IS = 256, (256 if WEIGHTS == "nvfp4" else 128), 8, (256 if WEIGHTS == "nvfp4" else 128)
    DENSE = {k: (256, 512) for k in DENSE}
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    import bench_moe  # pylint: disable=g-import-not-at-top
    bench_moe.TINY = True
    with plgpu.force_gpu_interpret_mode():
      return run(args)
  return run(args)


def run(args):
  res = {"device": jax.devices()[0].device_kind, "weights": WEIGHTS, "copy": {}, "moe_decode": [],
         "moe_prefill": [], "dense": []}

  def dump():
    if args.out:
      with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)

  t0 = time.time()
  res["copy"] = safe(copy_bandwidth) if not args.tiny else {}
  print("copy", res["copy"], flush=True)
  dump()
  for name in [v for v in args.dense.split(",") if v]:
    for t in [int(v) for v in args.dense_tokens.split(",") if v]:
      r = safe(bench_dense, name, t, args)
      r.setdefault("proj", name), r.setdefault("T", t), r.setdefault("tiles", "")
      res["dense"].append(r)
      print(r, f"{time.time() - t0:.0f}s", flush=True)
      dump()
  q, b = make_moe_weights(jax.random.key(0))
  jax.block_until_ready((q, b))
  for t in [int(v) for v in args.decode.split(",") if v]:
    r = safe(bench_moe_decode, t, q, b, args)
    r.setdefault("T", t), r.setdefault("touched", "-"), r.setdefault("fp8_GB", "-")
    res["moe_decode"].append(r)
    print(r, f"{time.time() - t0:.0f}s", flush=True)
    dump()
  for t in [int(v) for v in args.prefill.split(",") if v]:
    r = safe(bench_moe_prefill, t, q, b, args)
    r.setdefault("T", t)
    res["moe_prefill"].append(r)
    print(r, f"{time.time() - t0:.0f}s", flush=True)
    dump()
  print(summarize(res))
  for r in res["moe_decode"] + res["moe_prefill"]:
    print(f"  T={r['T']}", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                           if k.startswith("variant") or "cupti" in k})


if __name__ == "__main__":
  main()
