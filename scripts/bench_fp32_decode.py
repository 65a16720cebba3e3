"""fp32 decode on the MoE kernels: expert operands (bf16 hi / lo split) prepared once vs per call / per step.

fp32 weights run the MoE kernels through a bf16 [hi; lo; hi] copy of the expert weights (3x K). A decode loop
builds it once (``M3ForCausalLM.decode_weights``); before, every step rebuilt it (XLA:GPU keeps it in the loop).
Two measurements, both alternating the two variants in the same process:

  * ``moe_block`` alone, fp32, at T = 1 / 4 / 32 tokens, E = 128, H = 2048, I = Is = 512, top-4: GPU time per
    call (CUPTI, median) with ``prepared`` against without; outputs compared (bit-equal expected) and against
    the reference at HIGHEST precision; the bytes the prepared call must read (split operands of the touched
    experts + the shared expert) over the measured copy bandwidth give its roofline.
  * a decode loop of an fp32 research-size model (``--layers`` MoE layers at the same dims, kernels="pallas"):
    ms per step of an on-device ``fori_loop`` of ``--steps`` steps with ``decode_weights`` built before the
    loop, against the same loop passing none (each step prepares its weights, the previous behaviour).

Usage (on the GPU machine):  PYTHONPATH=$PWD python3 scripts/bench_fp32_decode.py --out $OUT/fp32.json
Smoke test on a CPU:         PYTHONPATH=$PWD python3 scripts/bench_fp32_decode.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bench_common
from bench_common import gpu_ms, timed_ms
from m3jax.config import M3Config, TextConfig
from m3jax.generate import _decode
from m3jax.model import M3ForCausalLM
from pallas_kernels.moe import moe_block, moe_block_reference, prepare_expert_weights, route_reference

COPY_TBPS = 4.3  # device copy, measured on the H200
KW = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)


def _block_inputs(t: int, h: int, i: int, e: int, seed: int):
  ks = jax.random.split(jax.random.key(seed), 7)
  n = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale
  return (n(ks[0], (t, h), 1.0), n(ks[1], (h, e), h ** -0.5), n(ks[2], (e,), 0.01),
          n(ks[3], (e, h, 2 * i), h ** -0.5), n(ks[4], (e, i, h), i ** -0.5),
          n(ks[5], (h, 2 * i), h ** -0.5), n(ks[6], (i, h), i ** -0.5))


def bench_block(t: int, h: int, i: int, e: int, top_k: int, rounds: int, interpret, iters: int = 5) -> dict:
  """fp32 moe_block with operands prepared once vs built per call (alternating rounds)."""
  args = _block_inputs(t, h, i, e, seed=t)
  kw = dict(KW, top_k=top_k, interpret=interpret)
  prepared = jax.block_until_ready(jax.jit(prepare_expert_weights, static_argnums=0)(jnp.float32, *args[3:]))
  per_call = jax.jit(lambda *a: moe_block(*a, **kw))
  once = jax.jit(lambda p, *a: moe_block(*a, **kw, prepared=p))
  out_once, out_per_call = np.asarray(once(prepared, *args)), np.asarray(per_call(*args))
  with jax.default_matmul_precision("highest"):
    ref = np.asarray(moe_block_reference(*args, **KW, top_k=top_k))
  times: dict[str, list[float]] = {"per_call": [], "prepared": []}
  timer = None
  for _ in range(rounds):
    _, ms, timer = gpu_ms(per_call, *args, iters=iters)
    times["per_call"].append(ms)
    _, ms, timer = gpu_ms(once, prepared, *args, iters=iters)
    times["prepared"].append(ms)
  _, ids, _ = route_reference(args[0], args[1], args[2], top_k=top_k)
  touched = len(np.unique(np.asarray(ids)))
  read = (touched + 1) * (3 * h * 2 * i + 3 * i * h) * 2  # bf16 split operands of the touched + shared experts
  med = {k: statistics.median(v) for k, v in times.items()}
  return {"T": t, "H": h, "I": i, "E": e, "top_k": top_k, "timer": timer, "per_call_ms": med["per_call"],
          "prepared_ms": med["prepared"], "speedup": med["per_call"] / med["prepared"], "touched_experts": touched,
          "prepared_read_gb": read / 1e9, "prepared_roofline_ms": read / (COPY_TBPS * 1e12) * 1e3,
          "prepared_vs_roofline": med["prepared"] / (read / (COPY_TBPS * 1e12) * 1e3),
          "bit_equal": bool(np.array_equal(out_once, out_per_call)),
          "rel_l2_vs_reference": float(np.linalg.norm(out_once - ref) / np.linalg.norm(ref))}


def model_config(layers: int, h: int, i: int, e: int, top_k: int) -> M3Config:
  """fp32 research-size model: every layer full attention + MoE (128-key blocks, head dim 128)."""
  text = TextConfig(vocab_size=4096, hidden_size=h, num_layers=layers, num_heads=16, num_kv_heads=4, head_dim=128,
                    intermediate_size=i, dense_intermediate_size=2 * i, shared_intermediate_size=i,
                    num_experts=e, num_experts_per_tok=top_k, attention_types=("full",) * layers,
                    mlp_types=("moe",) * layers, index_num_heads=4, index_head_dim=128, index_block_size=128,
                    index_topk_blocks=4, index_local_blocks=1)
  return M3Config(text=text)


def bench_loop(cfg: M3Config, batch: int, context: int, steps: int, rounds: int, repeats: int = 3) -> dict:
  """ms per decode step of an on-device loop, decode weights prepared once vs per step (alternating)."""
  model = M3ForCausalLM(cfg, dtype=jnp.float32, kernels="pallas", rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  caches = model.init_caches(batch, context)
  prepared = jax.block_until_ready(jax.jit(lambda s: nnx.merge(graphdef, s).decode_weights())(state))
  vocab = cfg.text.vocab_size

  @jax.jit
  def loop(state, prepared, caches):
    m = nnx.merge(graphdef, state)

    def body(k, carry):
      tok, caches = carry
      logits, caches = _decode(m, tok, jnp.full((batch,), context // 2, jnp.int32) + k, caches, prepared)
      return (jnp.argmax(logits, -1).astype(jnp.int32) + k) % vocab, caches
    tok, caches = jax.lax.fori_loop(0, steps, body, (jnp.arange(batch, dtype=jnp.int32), caches))
    return tok

  times: dict[str, list[float]] = {"per_step": [], "prepared": []}
  for _ in range(rounds):
    times["per_step"].append(timed_ms(loop, state, None, caches, repeats=repeats) / steps)
    times["prepared"].append(timed_ms(loop, state, prepared, caches, repeats=repeats) / steps)
  same = bool(np.array_equal(np.asarray(loop(state, None, caches)), np.asarray(loop(state, prepared, caches))))
  med = {k: statistics.median(v) for k, v in times.items()}
  expert_bytes = sum(x.nbytes for p in prepared if p.experts is not None
                     for x in jax.tree.leaves(p.experts))
  return {"layers": cfg.text.num_layers, "batch": batch, "context": context, "steps": steps,
          "per_step_ms": med["per_step"], "prepared_ms": med["prepared"],
          "speedup": med["per_step"] / med["prepared"], "same_tokens": same,
          "prepared_expert_operands_gb": expert_bytes / 1e9}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny dims in the GPU interpreter (CPU check of the script)")
  p.add_argument("--tokens", default="1,4,32", help="moe_block T values")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  h, i, e, top_k, context = (2048, 512, 128, 4, 1024) if not args.smoke else (256, 128, 8, 2, 256)
  interpret, block_iters, loop_repeats = False, 5, 3  # timed calls per measurement
  if args.smoke:  # interpret mode: its timings mean nothing, one call each (no warm-up) checks the code path
    bench_common.DRY_RUN = True
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    interpret = plgpu.InterpretGPUParams()
    args.rounds, args.steps, args.layers, args.batch, block_iters, loop_repeats = 1, 2, 1, 2, 1, 1
  res: dict = {"device": jax.devices()[0].device_kind, "block": [], "loop": None}

  def dump():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(res, f, indent=1)

  for t in [int(v) for v in args.tokens.split(",") if v]:
    res["block"].append(bench_block(t, h, i, e, top_k, args.rounds, interpret, iters=block_iters))
    print(json.dumps(res["block"][-1]), flush=True)
    dump()
  res["loop"] = bench_loop(model_config(args.layers, h, i, e, top_k), args.batch, context, args.steps, args.rounds,
                           repeats=loop_repeats)
  print(json.dumps(res["loop"]), flush=True)
  dump()


if __name__ == "__main__":
  main()
