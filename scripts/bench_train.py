"""Train-step throughput: tokens/s and model FLOP utilisation (MFU) of m3jax's jit-compiled train step.

Random token rows (the data pipeline is not timed), fp32 master weights, AdamW, the full objective (LM + MTP +
indexer alignment, router balancing), in the sparse phase (or --dense for the warm-up phase). MFU = model
FLOPs per token (m3jax.training.flops: 3 x forward, the attention counted as the sparse layers compute it) x
tokens/s / (devices x peak FLOP/s) (--peak-tflops; default: 989 for bf16 / 67 for fp32 on an H100 or H200, none on CPU).

  python scripts/bench_train.py --config configs/m3_100m.json --batch 16 --seq-len 2048 --steps 10
  python scripts/bench_train.py --config configs/m3_small_kjv.json --batch 32 --seq-len 512 --compute-dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import M3Config
from m3jax import sharding
from m3jax.logical_axes import ACT_BATCH, ACT_SEQ
from m3jax.training.flops import train_flops_per_token
from m3jax.training.optimizer import OptimizerConfig, make_optimizer
from m3jax.training.params import count_params, init_master, make_layout
from m3jax.training.step import ObjectiveConfig, init_state, make_train_step

PEAK_TFLOPS = {("H100", "bfloat16"): 989.0, ("H200", "bfloat16"): 989.0, ("H100", "float32"): 67.0,
               ("H200", "float32"): 67.0}


def default_peak(dtype: str) -> float | None:
  kind = jax.devices()[0].device_kind
  for (name, dt), tflops in PEAK_TFLOPS.items():
    if name in kind and dt == dtype:
      return tflops
  return None


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=10, help="timed steps (after one compiling step)")
  ap.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--mesh", default=None, help="e.g. data=8 (default: one device)")
  ap.add_argument("--dense", action="store_true", help="time the dense warm-up phase instead of the sparse one")
  ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by device kind)")
  ap.add_argument("--out", default=None, help="also write the result as JSON here")
  args = ap.parse_args()

  cfg = M3Config.from_file(args.config)
  plan = None if args.mesh is None else sharding.ShardingPlan(sharding.make_mesh(args.mesh))
  with_mtp = cfg.text.num_mtp_modules > 0
  layout = make_layout(cfg, jnp.dtype(args.compute_dtype), with_mtp=with_mtp, plan=plan)
  opt = OptimizerConfig(total_steps=args.steps + 1, warmup_steps=0)
  tx = make_optimizer(opt)
  master = init_master(layout, 0)
  state = init_state(layout, tx, master)
  step = make_train_step(layout, opt, ObjectiveConfig(), sparse=not args.dense,
                         state_shardings=jax.tree.map(lambda x: x.sharding, state))
  rng = np.random.default_rng(0)

  def rows() -> jax.Array:
    x = rng.integers(0, cfg.text.vocab_size, (args.batch, args.seq_len)).astype(np.int32)
    return jnp.asarray(x) if plan is None else jax.device_put(x, plan.sharding((ACT_BATCH, ACT_SEQ), x.shape))

  t0 = time.perf_counter()
  state, metrics = step(state, rows())
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.steps):
    batch = rows()
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  tokens_s = args.batch * args.seq_len / seconds
  flops_token = train_flops_per_token(cfg, args.seq_len, with_mtp)
  peak = args.peak_tflops or default_peak(args.compute_dtype)
  result = {
      "device": jax.devices()[0].device_kind, "devices": 1 if plan is None else plan.mesh.size,
      "config": args.config, "params": count_params(state["params"]), "batch": args.batch, "seq_len": args.seq_len,
      "compute_dtype": args.compute_dtype, "phase": "dense" if args.dense else "sparse",
      "first_step_s": round(compile_s, 2), "step_s_median": seconds, "tokens_per_s": tokens_s,
      "model_tflops_per_s": flops_token * tokens_s / 1e12, "train_flops_per_token": flops_token,
      "peak_tflops_per_device": peak,
      "mfu": None if peak is None else flops_token * tokens_s / (peak * 1e12 * (1 if plan is None else plan.mesh.size)),
      "loss": float(metrics["loss"]),
  }
  print(json.dumps(result, indent=2))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
