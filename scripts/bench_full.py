"""Full-size MiniMax M3 (all 60 layers, real dims) sharded over several GPUs: prefill and decode throughput.

Random bf16 weights are initialised directly sharded (one jit with out_shardings: no host copy). Measures:
  * prefill: batch 1 x 8192-token prompt, time to first token and tokens/s per GPU;
  * decode: 8K-token prompts then decode steps at concurrency 4 and 64: time per output token (median step)
    and total output tokens/s per GPU;
next to the published H200 figures for the same model and the weight-read roofline (bf16 weights touched per
step / (GPUs x 4.3 TB/s)).

  8 GPUs:     PYTHONPATH=$PWD python3 scripts/bench_full.py --mesh tensor=8            (or expert=8, ...)
  dry run:    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
              PYTHONPATH=$PWD python3 scripts/bench_full.py --mesh tensor=8 --dry-run
              (lowers + compiles the sharded init of the full model and prints its per-device memory plan)
  CPU smoke:  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
              PYTHONPATH=$PWD python3 scripts/bench_full.py --mesh expert=4,tensor=2 --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import sharding
from m3jax.config import M3Config, TextConfig, m3_full
from m3jax.generate import _decode, _prefill
from bench_common import timed_ms
from m3jax.model import M3ForCausalLM
from m3jax.parallel.memory import plan_memory

COPY_TBPS = 4.3
PUBLISHED = {  # H200, same model (issue text)
    "SGLang BF16 TP8, concurrency 64": {"tok_s_per_gpu": 550.0, "tpot_ms": 11.5, "ttft_s": 114.0},
    "vLLM FP8 TP8, concurrency 4": {"tok_s_per_gpu": 113.0, "tpot_ms": 8.4},
}


def model_config(layers: int | None, smoke: bool) -> M3Config:
  text = m3_full().text
  if smoke:
    text = TextConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                      intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, attention_types=("full", "sparse", "sparse", "sparse"),
                      mlp_types=("dense", "moe", "moe", "moe"), index_num_heads=2, index_head_dim=32,
                      index_block_size=16, index_topk_blocks=2, index_local_blocks=1)
  elif layers is not None:  # keep the 3 dense layers first, then sparse MoE layers
    n_dense = min(3, layers)
    text = dataclasses.replace(text, num_layers=layers,
                               attention_types=("full",) * n_dense + ("sparse",) * (layers - n_dense),
                               mlp_types=("dense",) * n_dense + ("moe",) * (layers - n_dense))
  return M3Config(text=text)


def sharded_init(cfg: M3Config, plan: sharding.ShardingPlan, kernels: str, dtype) -> tuple[M3ForCausalLM, object]:
  """(model with parameters created directly in their shards, the jitted init for inspection)."""
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=kernels))
  flat = list(nnx.to_flat_state(nnx.state(abstract)))
  keys = ["/".join(map(str, path)) for path, _ in flat]
  out_shardings = {k: plan.sharding(sharding.logical_axes_of(var), var.shape) for k, (_, var) in zip(keys, flat)}

  @functools.partial(jax.jit, out_shardings=out_shardings)
  def init():
    model = M3ForCausalLM(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0))
    return {k: var.get_value() for k, (_, var) in zip(keys, nnx.to_flat_state(nnx.state(model)))}

  return abstract, flat, keys, init


def decode_weight_bytes(t: TextConfig, batch: int) -> float:
  """bf16 weights one decode step reads (expected distinct experts under uniform routing), all GPUs together."""
  h = t.hidden_size
  attn = h * (2 * t.num_heads * t.head_dim + 2 * t.num_kv_heads * t.head_dim)
  idx = h * (t.index_num_heads + 1) * t.index_head_dim
  distinct = t.num_experts * (1 - (1 - t.num_experts_per_tok / t.num_experts) ** batch)
  total = h * t.vocab_size
  for kind, mlp in zip(t.attention_types, t.mlp_types):
    total += attn + (idx if kind == "sparse" else 0)
    total += (3 * h * t.dense_intermediate_size if mlp == "dense"
              else 3 * h * (t.shared_intermediate_size + distinct * t.intermediate_size))
  return 2 * total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mesh", default="tensor=8", help="e.g. tensor=8, expert=8, expert=4,tensor=2")
  parser.add_argument("--layers", type=int, default=None, help="fewer layers (e.g. a 1-GPU run); default all 60")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--dry-run", action="store_true", help="lower + compile the sharded init only")
  parser.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the whole flow)")
  parser.add_argument("--prompt", type=int, default=8192)
  parser.add_argument("--concurrency", default="4,64")
  parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (TPOT = their median)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  cfg = model_config(args.layers, args.smoke)
  t = cfg.text
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  mesh = sharding.make_mesh(args.mesh)
  plan = sharding.ShardingPlan(mesh, sharding.RULES)
  sharding.check_config(cfg, mesh, plan.rules)
  n_dev = mesh.size
  prompt = 64 if args.smoke else args.prompt
  concurrency = [int(c) for c in args.concurrency.split(",")]
  mem = plan_memory(cfg, mesh, batch=max(concurrency), context=prompt + 1024, dtype=dtype)
  print(f"devices: {n_dev} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; layers {t.num_layers}")
  print(mem)

  abstract, flat, keys, init = sharded_init(cfg, plan, args.kernels, dtype)
  n_params = sum(int(np.prod(var.shape)) for _, var in flat)
  print(f"parameters: {n_params / 1e9:.1f}B")
  if args.dry_run:
    start = time.perf_counter()
    compiled = init.lower().compile()
    analysis = compiled.memory_analysis()
    out_bytes = getattr(analysis, "output_size_in_bytes", None)
    print(f"sharded init lowered + compiled in {time.perf_counter() - start:.1f}s; per-device output "
          f"{out_bytes / 2**30:.1f} GiB" if out_bytes else "compiled (no memory analysis on this backend)")
    return

  start = time.perf_counter()
  arrays = init()
  jax.block_until_ready(arrays)
  for (path, var), k in zip(flat, keys):
    var.set_value(arrays[k])
  model = nnx.merge(nnx.graphdef(abstract), nnx.from_flat_state(flat))
  model.sharding_plan = plan
  print(f"sharded random init: {time.perf_counter() - start:.1f}s; per-device bytes "
        f"{max(sharding.per_device_bytes(nnx.state(model)).values()) / 2**30:.1f} GiB")
  graphdef, state = nnx.split(model)
  report: dict = {"mesh": dict(mesh.shape), "devices": n_dev, "layers": t.num_layers, "published": PUBLISHED}

  cache_len = -(-(prompt + 1024 + 1) // 128) * 128

  @functools.partial(jax.jit, static_argnames=("cache_len",))
  def prefill(state, ids, lengths, cache_len):
    return _prefill(nnx.merge(graphdef, state), ids, lengths, cache_len)

  @functools.partial(jax.jit, donate_argnames=("caches",))
  def step(state, tok, pos, caches):
    return _decode(nnx.merge(graphdef, state), tok, pos, caches)

  put = functools.partial(sharding.put_replicated, plan=plan)
  ids = put(np.asarray(jax.random.randint(jax.random.key(0), (1, prompt), 0, t.vocab_size), np.int32))
  ms = timed_ms(lambda: prefill(state, ids, put(np.asarray([prompt], np.int32)), cache_len)[0], repeats=3)
  report["prefill"] = {"ttft_ms": ms, "tok_s_per_gpu": prompt / ms * 1e3 / n_dev}
  print(f"prefill {prompt} tokens: TTFT {ms:.1f} ms, {prompt / ms * 1e3 / n_dev:.0f} tok/s per GPU", flush=True)

  for c in concurrency:
    batch_ids = put(np.asarray(jax.random.randint(jax.random.key(c), (c, prompt), 0, t.vocab_size), np.int32))
    logits, caches = prefill(state, batch_ids, put(np.full((c,), prompt, np.int32)), cache_len)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    times = []
    for i in range(args.decode_steps + 2):
      start = time.perf_counter()
      logits, caches = step(state, tok, put(np.full((c,), prompt + i, np.int32)), caches)
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      tok.block_until_ready()
      times.append((time.perf_counter() - start) * 1e3)
    tpot = statistics.median(times[2:])
    roof = decode_weight_bytes(t, c) / (n_dev * COPY_TBPS * 1e12) * 1e3
    report[f"decode_c{c}"] = {"tpot_ms": tpot, "tok_s_per_gpu": c / tpot * 1e3 / n_dev, "roofline_ms": roof}
    print(f"decode concurrency {c}: TPOT {tpot:.2f} ms (weight-read roofline {roof:.2f} ms), "
          f"{c / tpot * 1e3 / n_dev:.0f} tok/s per GPU", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)


if __name__ == "__main__":
  main()
