"""Sharding overheads.

Mode ``trivial`` (GPU): does a one-device mesh cost anything against the unsharded model? A real-dims M3 slice
(embeddings + LM head, layer 0 full attention + dense MLP, layer 1 sparse attention + 128-expert MoE; random
bf16 weights made on the device) runs unsharded and through ``m3jax.sharding.shard_model(model,
make_mesh("data=1"))`` (NamedSharding parameters, sharding plan active: logical constraints on the residual,
caches and logits). Measured, interleaved A/B/A/B: prefill (batch 1, S tokens, logits at the last token) and one
decode step (batch B over an S-token cache). Results are written to --out after every measurement.

Mode ``moe-cpu`` (CPU, 8 simulated devices): the MoE block at small dims on mesh expert=8: unsharded (one
device), expert-parallel shard_map (gather / scatter, m3jax.parallel.moe), and the reference left to XLA's
automatic partitioning (experts sharded, no shard_map). CPU timings only: no interconnect is modelled.

Mode ``moe-gpu`` (one GPU, M3 MoE dims): the expert-parallel code path (m3jax.parallel.moe: routing, then the
per-device ``routed_experts`` under shard_map, shared expert beside it) on a one-device ``expert=1`` mesh, with
the Pallas kernel and with the ragged_dot reference, next to the fused single-device ``moe_block`` kernel.

  GPU:   PYTHONPATH=$PWD python3 scripts/bench_sharding.py trivial --out $OUT/sharding.json
         PYTHONPATH=$PWD python3 scripts/bench_sharding.py moe-gpu --out $OUT/moe_ep.json
  CPU:   PYTHONPATH=$PWD python3 scripts/bench_sharding.py trivial --smoke
         PYTHONPATH=$PWD python3 scripts/bench_sharding.py moe-cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] == "moe-cpu":  # before jax is imported
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from m3jax import sharding  # noqa: E402
from m3jax.config import M3Config, TextConfig, m3_full  # noqa: E402
from m3jax.generate import _decode, _prefill  # noqa: E402
from m3jax.model import M3ForCausalLM  # noqa: E402


def slice_config(smoke: bool) -> M3Config:
  layout = dict(num_layers=2, attention_types=("full", "sparse"), mlp_types=("dense", "moe"))
  if smoke:
    text = TextConfig(vocab_size=512, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=32,
                      intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, index_num_heads=2, index_head_dim=32,
                      index_block_size=16, index_topk_blocks=2, **layout)
  else:
    text = dataclasses.replace(m3_full().text, **layout)
  return M3Config(text=text)


def _timed_pair(fns: dict, args: dict, repeats: int) -> dict[str, float]:
  """Median ms per variant, calls interleaved (A, B, A, B, ...) after one warm-up each."""
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args[name]))
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      times[name].append((time.perf_counter() - start) * 1e3)
  return {name: statistics.median(t) for name, t in times.items()}


def trivial(args: argparse.Namespace) -> dict:
  cfg = slice_config(args.smoke)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  start = time.perf_counter()
  model = nnx.jit(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=args.kernels, rngs=nnx.Rngs(0)))()
  graphdef, state = nnx.split(model)
  jax.block_until_ready(state)
  sharded = sharding.shard_model(nnx.merge(graphdef, state), sharding.make_mesh("data=1"))
  variants = {"unsharded": (graphdef, state), "mesh data=1": nnx.split(sharded)}
  report = {"device": jax.devices()[0].device_kind, "kernels": model.kernels, "jax": jax.__version__,
            "params": int(sum(x.size for x in jax.tree.leaves(state))), "init_s": time.perf_counter() - start,
            "results": {}}
  print(f"device {report['device']}, {report['params'] / 1e9:.2f}B params, kernels {model.kernels}", flush=True)
  s, b = (64, 2) if args.smoke else (args.seq, args.batch)
  cache_len = s + 128
  ids = jax.random.randint(jax.random.key(0), (b, s), 0, cfg.text.vocab_size, jnp.int32)
  lengths = jnp.full((b,), s, jnp.int32)

  def dump():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

  prefill_fns, decode_fns, prefill_args, decode_args = {}, {}, {}, {}
  for name, (g, st) in variants.items():
    prefill_fns[name] = jax.jit(lambda st, ids, lens, g=g: _prefill(nnx.merge(g, st), ids, lens, cache_len))
    decode_fns[name] = jax.jit(lambda st, tok, pos, caches, g=g: _decode(nnx.merge(g, st), tok, pos, caches))
    prefill_args[name] = (st, ids[:1], lengths[:1])
  ms = _timed_pair(prefill_fns, prefill_args, args.repeats)
  report["results"][f"prefill_b1_s{s}_ms"] = ms
  print(f"prefill B=1 S={s}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
  dump()
  for name, (g, st) in variants.items():
    logits, caches = prefill_fns[name](st, ids, lengths)
    decode_args[name] = (st, jnp.argmax(logits, -1).astype(jnp.int32), lengths, caches)
  ms = _timed_pair(decode_fns, decode_args, args.repeats * 4)
  report["results"][f"decode_b{b}_ctx{s}_ms"] = ms
  print(f"decode B={b} ctx={s}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
  same = {name: np.asarray(decode_fns[name](*decode_args[name])[0]) for name in variants}
  report["decode_logits_max_abs_diff"] = float(np.max(np.abs(same["unsharded"] - same["mesh data=1"])))
  dump()
  return report


def moe_cpu(args: argparse.Namespace) -> dict:
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from m3jax.parallel import moe as parallel_moe  # pylint: disable=g-import-not-at-top
  from pallas_kernels.moe.reference import moe_block_reference  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_default_matmul_precision", "highest")
  h, i, e, k, t = 256, 128, 32, 4, args.tokens
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (1, t, h), jnp.float32)
  w = dict(router_w=jax.random.normal(keys[1], (h, e)) * 0.05, correction_bias=jnp.zeros((e,)),
           w_gate_up=jax.random.normal(keys[2], (e, h, 2 * i)) * 0.05, w_down=jax.random.normal(keys[3], (e, i, h)) * 0.05,
           shared_gate_up=jax.random.normal(keys[4], (h, 2 * i)) * 0.05, shared_down=jax.random.normal(keys[5], (i, h)) * 0.05)
  kw = dict(top_k=k, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
  mesh = sharding.make_mesh("expert=8")
  plan = sharding.ShardingPlan(mesh)
  exp = NamedSharding(mesh, P("expert", None, None))
  rep = NamedSharding(mesh, P())
  w_sharded = {n: jax.device_put(v, exp if n.startswith("w_") else rep) for n, v in w.items()}
  x_rep = jax.device_put(x, rep)
  order = ("router_w", "correction_bias", "w_gate_up", "w_down", "shared_gate_up", "shared_down")
  single = jax.jit(lambda x, *ws: moe_block_reference(x[0], *ws, **kw)[None])
  ep = jax.jit(lambda x, *ws: parallel_moe.moe_block(plan, x, *ws, **kw))
  auto = jax.jit(lambda x, *ws: moe_block_reference(x[0], *ws, **kw)[None])
  fns = {"one device": single, "expert=8 shard_map gather/scatter": ep, "expert=8 XLA auto-partitioned": auto}
  fargs = {"one device": (x, *(w[n] for n in order)),
           "expert=8 shard_map gather/scatter": (x_rep, *(w_sharded[n] for n in order)),
           "expert=8 XLA auto-partitioned": (x_rep, *(w_sharded[n] for n in order))}
  ref = np.asarray(single(*fargs["one device"]))
  errs = {n: float(np.max(np.abs(np.asarray(f(*fargs[n])) - ref)) / np.max(np.abs(ref))) for n, f in fns.items()}
  ms = _timed_pair(fns, fargs, args.repeats)
  for n in fns:
    print(f"MoE T={t} H={h} I={i} E={e} top-{k}: {n}: {ms[n]:.2f} ms (rel err {errs[n]:.1e})", flush=True)
  report = {"cpu_devices": jax.device_count(), "tokens": t, "ms": ms, "rel_err": errs}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


def moe_gpu(args: argparse.Namespace) -> dict:
  from m3jax.parallel import moe as parallel_moe  # pylint: disable=g-import-not-at-top
  from pallas_kernels.moe import moe_block  # pylint: disable=g-import-not-at-top
  from pallas_kernels.moe.reference import moe_block_reference  # pylint: disable=g-import-not-at-top

  h, i, e, k = 6144, 3072, 128, 4
  keys = jax.random.split(jax.random.key(0), 7)
  nrm = lambda key, shape, sc, dt=jnp.bfloat16: (jax.random.normal(key, shape, jnp.float32) * sc).astype(dt)
  ws = (nrm(keys[1], (h, e), h ** -0.5, jnp.float32), nrm(keys[2], (e,), 0.01, jnp.float32),
        nrm(keys[3], (e, h, 2 * i), h ** -0.5), nrm(keys[4], (e, i, h), i ** -0.5),
        nrm(keys[5], (h, 2 * i), h ** -0.5), nrm(keys[6], (i, h), i ** -0.5))
  kw = dict(top_k=k, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
  plan = sharding.ShardingPlan(sharding.make_mesh("expert=1"))
  fns = {"moe_block kernel (fused shared expert)": jax.jit(lambda x, *w: moe_block(x[0], *w, **kw)[None]),
         "EP path, routed_experts kernel": jax.jit(
             lambda x, *w: parallel_moe.moe_block(plan, x, *w, **kw, kernels="auto")),
         "EP path, ragged_dot reference": jax.jit(
             lambda x, *w: parallel_moe.moe_block(plan, x, *w, **kw, kernels="reference"))}
  report = {"device": jax.devices()[0].device_kind, "ms": {}, "rel_err_vs_reference": {}}
  for t in [int(v) for v in args.moe_tokens.split(",")]:
    x = jax.random.normal(keys[0], (1, t, h), jnp.float32).astype(jnp.bfloat16)
    use = {n: f for n, f in fns.items() if "ragged_dot" not in n or t <= 4096}  # ragged_dot: [T*K, E*H] temp
    with sharding.use_plan(plan):
      ms = _timed_pair(use, {n: (x, *ws) for n in use}, args.repeats)
      ref = np.asarray(moe_block_reference(x[0], *ws, **kw).astype(jnp.float32))
      errs = {n: float(np.linalg.norm(np.asarray(f(x, *ws)[0].astype(jnp.float32)) - ref) / np.linalg.norm(ref))
              for n, f in use.items()}
    report["ms"][t], report["rel_err_vs_reference"][t] = ms, errs
    for n in use:
      print(f"MoE T={t}: {n}: {ms[n]:.3f} ms (rel L2 vs reference {errs[n]:.1e})", flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("mode", choices=("trivial", "moe-cpu", "moe-gpu"))
  parser.add_argument("--smoke", action="store_true", help="trivial: tiny dims (a CPU check of the script)")
  parser.add_argument("--kernels", default=None,
                      help="trivial: reference | pallas | auto, or a fallback list like auto,reference (default auto)")
  parser.add_argument("--seq", type=int, default=4096, help="trivial: prompt / cache tokens")
  parser.add_argument("--batch", type=int, default=8, help="trivial: decode batch")
  parser.add_argument("--tokens", type=int, default=2048, help="moe-cpu: tokens")
  parser.add_argument("--moe-tokens", default="1,8,64,4096", help="moe-gpu: comma-separated token counts")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", default=None, help="write results as JSON here")
  args = parser.parse_args()
  if args.mode == "moe-cpu":
    moe_cpu(args)
    return
  if args.mode == "moe-gpu":
    moe_gpu(args)
    return
  choices = (args.kernels or "auto").split(",")
  for i, kernels in enumerate(choices):  # e.g. auto,reference: fall back if a kernel path fails
    try:
      trivial(argparse.Namespace(
          **{**vars(args), "kernels": kernels,
             "out": args.out if i == 0 else (args.out and args.out.replace(".json", f"_{kernels}.json"))}))
      return
    except Exception as e:  # pylint: disable=broad-except
      print(f"kernels={kernels} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
  sys.exit(1)


if __name__ == "__main__":
  main()
