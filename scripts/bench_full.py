"""Full-size MiniMax M3 (all 60 layers, real dims) sharded over several GPUs: prefill and decode throughput.

Random bf16 weights are created directly in their shards (jitted per parameter shape: no host copy). Measures:
  * prefill: batch 1 x 8192-token prompt, time to first token and tokens/s per GPU;
  * decode: caches holding 8K-token contexts, then decode steps at concurrency 4 and 64: time per output token
    (TPOT) two ways -- the median of single steps, each synchronised with the host (sync), and the mean of
    --decode-steps steps dispatched back to back, each feeding the next (chained, as a serving loop or
    ``m3jax.generate``'s on-device loop runs them) -- and total output tokens/s per GPU;
next to the published H200 figures for the same model and the weight-read roofline (weights touched per step /
(GPUs x the card's copy bandwidth, measured at the start of the run: ``bench_common.copy_tbps``)).

Weights (``--weights``): bf16, or MXFP8 (every linear weight the model can keep in fp8 -- attention / indexer
projections, dense and shared MLPs, routed experts -- as ``QuantizedLinear``: random e4m3 values and E8M0 scales
drawn on the device in their shards; the fp8 kernels read them). With ``--one-shard``, ``--layout`` picks the
expert layout of the split one GPU stands for: ``slices`` (every expert at 1/WAYS width, SGLang's TP8) or
``experts`` (E/WAYS whole experts, m3jax's meshes; routing over all E): see scripts/shard_layouts.py.

Decode caches are filled with random keys / values / index keys by default (--fill random): a decode step
reads the same bytes and selects the same number of blocks whatever the cached values, and a real prefill of
64 x 8K tokens costs minutes. --fill prefill prefills them from random prompts, --fill-batch sequences at a
time.

  8 GPUs:     PYTHONPATH=$PWD python3 scripts/bench_full.py --mesh tensor=8            (or expert=8, ...)
  one shard:  XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 PYTHONPATH=$PWD python3 scripts/bench_full.py --one-shard 8
              (one GPU: the work and memory of one GPU of an 8-way tensor-parallel split of the full model,
              all 60 layers -- see shard_config; no collectives, so a lower bound on the 8-GPU times)
  MXFP8:      ... bench_full.py --one-shard 8 --weights mxfp8 --layout experts   (60 layers fit an H100's 80 GB;
              the bf16 shard needs 99.6 GiB: --layers 30 for its H100 baseline)
  cold start: --timing loop --balance-once --prefill-last (one 60-layer compile per concurrency, plus one
              for the routing calibration and one for the prefill: ~45 s each on the GPU host)
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
from m3jax.cache import LayerCache
from m3jax.config import M3Config, TextConfig, m3_full
from m3jax.generate import _decode, _prefill
from bench_common import copy_tbps, timed_ms
from decode_analysis import balance_routing, dispatch_probe, routed_expert_counts, stream_tpot
from m3jax.model import M3ForCausalLM
from m3jax.checkpoint.fit import device_limit
from m3jax.layers.quantized import quantize_all
from m3jax.parallel.memory import plan_memory
from shard_layouts import LAYOUTS, WEIGHTS, build_model, local_experts, random_leaf, shard_weight_bytes

CALIBRATION_TOKENS = 64  # tokens per concurrency that set the MoE selection biases (balance_routing)
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
    if layers is not None:  # the smoke pattern (one dense layer, then sparse MoE layers) at this depth
      text = dataclasses.replace(text, num_layers=layers, attention_types=("full",) + ("sparse",) * (layers - 1),
                                 mlp_types=("dense",) + ("moe",) * (layers - 1))
  elif layers is not None:  # keep the 3 dense layers first, then sparse MoE layers
    n_dense = min(3, layers)
    text = dataclasses.replace(text, num_layers=layers,
                               attention_types=("full",) * n_dense + ("sparse",) * (layers - n_dense),
                               mlp_types=("dense",) * n_dense + ("moe",) * (layers - n_dense))
  return M3Config(text=text)


def shard_config(text: TextConfig, ways: int, layout: str = "slices") -> TextConfig:
  """The model one GPU computes in a ``ways``-way tensor-parallel split of ``text`` (as SGLang's TP8 splits M3).

  Query heads, the dense / shared MLP widths, each routed expert's width and the vocabulary are divided by
  ``ways``; KV and index heads too, with at least one per GPU (more ranks than KV heads replicate them, as
  vLLM and m3jax.sharding do). Every routed expert stays (1/ways of each), so a decode step reads 1/ways of the
  expert bytes the full model reads; m3jax's own meshes place whole experts instead (expert parallelism),
  which reads the same bytes per GPU in expectation: ``layout='experts'`` keeps the experts' whole width (the
  router still spans all E; shard_layouts.build_model keeps E/ways of them). Raises ValueError naming any width
  ``ways`` does not divide.
  """
  def split(name: str) -> int:
    value = getattr(text, name)
    if value % ways:
      raise ValueError(f"--one-shard {ways}: {name} = {value} is not divisible by {ways}")
    return value // ways

  kv = max(1, text.num_kv_heads // ways)
  if text.num_kv_heads > ways and text.num_kv_heads % ways:
    raise ValueError(f"--one-shard {ways}: num_kv_heads = {text.num_kv_heads} is not divisible by {ways}")
  if ways > text.num_kv_heads and ways % text.num_kv_heads:
    raise ValueError(f"--one-shard {ways}: {ways} ranks cannot replicate {text.num_kv_heads} KV heads evenly")
  if layout == "experts":
    local_experts(text, ways)
  inter = text.intermediate_size if layout == "experts" else split("intermediate_size")
  return dataclasses.replace(
      text, num_heads=split("num_heads"), num_kv_heads=kv, index_num_heads=kv, intermediate_size=inter,
      shared_intermediate_size=split("shared_intermediate_size"),
      dense_intermediate_size=split("dense_intermediate_size"), vocab_size=split("vocab_size"))


def sharded_init(cfg: M3Config, plan: sharding.ShardingPlan, kernels: str, dtype, weights: str = "bf16",
                 layout: str = "slices", ways: int | None = None):
  """(abstract model, its flat state, the state's keys, their shardings, a jitted init of the whole model); the
  model is ``shard_layouts.build_model``'s (``weights`` bf16 / mxfp8, ``layout`` slices / experts).

  The whole-model init (one jit with out_shardings) is what --dry-run lowers; a run fills the parameters leaf by
  leaf instead (random_params): one jit compiles 60 layers of initialisers very slowly (over 6 minutes for the
  full model on the GPU host), while per-leaf jits compile once per distinct shape.
  """
  build = functools.partial(build_model, cfg, dtype=dtype, kernels=kernels, weights=weights, layout=layout, ways=ways)
  abstract = nnx.eval_shape(lambda: build(rngs=nnx.Rngs(0)))
  flat = list(nnx.to_flat_state(nnx.state(abstract)))
  keys = ["/".join(map(str, path)) for path, _ in flat]
  out_shardings = {k: jax.sharding.NamedSharding(plan.mesh, sharding.param_spec(var, plan))
                   for k, (_, var) in zip(keys, flat)}

  @functools.partial(jax.jit, out_shardings=out_shardings)
  def init():
    model = build(rngs=nnx.Rngs(0))
    return {k: var.get_value() for k, (_, var) in zip(keys, nnx.to_flat_state(nnx.state(model)))}

  return abstract, flat, keys, out_shardings, init


_normal_leaf = random_leaf  # float leaves: N(0, std^2) (std 0.02: make_param's init)


def random_params(flat, keys, out_shardings, seed: int = 0) -> None:
  """Sets every abstract parameter of ``flat`` to random values in its sharding (no host copy): float ones
  N(0, 0.02^2), fp8 values and E8M0 scales as ``shard_layouts.random_leaf`` draws them."""
  base = jax.random.key(seed)
  for i, ((_, var), k) in enumerate(zip(flat, keys)):
    var.set_value(random_leaf(tuple(var.shape), jnp.dtype(var.dtype), out_shardings[k])(jax.random.fold_in(base, i)))


def random_caches(model: M3ForCausalLM, plan: sharding.ShardingPlan, batch: int, cache_len: int, *,
                  mtp: bool = False, seed: int | None = None):
  """The model's per-layer caches (``init_caches``' shapes, dtypes and layout under ``plan``; ``mtp``: the MTP
  modules' caches, ``init_mtp_caches``) for ``batch`` sequences x cache_len slots, holding random N(0, 1) values
  (seed: default ``batch``); each array is drawn by a per-shape jit, as the parameters are (one jit over all 60
  layers' caches took about two minutes to compile on the GPU host)."""
  init = model.init_mtp_caches if mtp else model.init_caches
  abstract = jax.eval_shape(lambda: init(batch, cache_len))
  base = jax.random.key(batch if seed is None else seed)

  def draw(i: int, names: tuple[str, ...], x) -> jax.Array:
    make = _normal_leaf(tuple(x.shape), jnp.dtype(x.dtype), plan.sharding(names, x.shape), 1.0)
    return make(jax.random.fold_in(base, i))

  return tuple(
      LayerCache(**{field: None if getattr(c, field) is None else draw(3 * i + j, LayerCache.LOGICAL_AXES[field],
                                                                        getattr(c, field))
                    for j, field in enumerate(("k", "v", "idx_k"))})
      for i, c in enumerate(abstract))


def parse_compiler_options(items: list[str]) -> dict[str, object] | None:
  """["name=value", ...] -> {name: value} for ``jax.jit(compiler_options=...)``; ints and booleans are typed."""
  options: dict[str, object] = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or not name:
      raise ValueError(f"--compiler-option expects NAME=VALUE, got {item!r}")
    if value.lower() in ("true", "false"):
      options[name] = value.lower() == "true"
    else:
      try:
        options[name] = int(value)
      except ValueError:
        options[name] = value
  return options or None


def prefill_chunk_rows(prefill, state, ids, lengths, cache_len: int, chunks: list[int]) -> list[dict]:
  """The one-shot prefill and the chunked ones: wall time (median of 3), XLA's temporary buffer size of each
  compiled program (activations and workspace; weights are arguments, caches outputs), and the chunked last-token
  logits against the one-shot's."""
  rows, want = [], None
  for chunk in [None] + chunks:
    # One compile per program: the AOT executable is both measured (memory) and run (jit's cache is separate).
    compiled = prefill.lower(state, ids, lengths, cache_len, chunk).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    logits = np.asarray(jax.block_until_ready(compiled(state, ids, lengths)[0]), np.float32)
    want = logits if want is None else want
    ms = timed_ms(lambda: compiled(state, ids, lengths)[0], repeats=3)
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    rows.append({"chunk": chunk, "ms": ms, "temp_bytes": temp, "logits_rel_err_vs_one_shot": rel})
    print(f"prefill chunk {chunk or 'none (one shot)'}: {ms:.1f} ms, temporary memory "
          f"{'n/a' if temp is None else f'{temp / 2**30:.2f} GiB'}, last-token logits rel err {rel:.1e}", flush=True)
  return rows


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mesh", default="tensor=8", help="e.g. tensor=8, expert=8, expert=4,tensor=2")
  parser.add_argument("--one-shard", type=int, default=None, metavar="WAYS",
                      help="run one GPU's share of a WAYS-way tensor-parallel split on one device (shard_config)")
  parser.add_argument("--layout", choices=LAYOUTS, default="slices",
                      help="with --one-shard: the routed experts of the split, every expert at 1/WAYS width "
                           "(slices, SGLang's TP8) or E/WAYS whole experts (experts, m3jax's meshes)")
  parser.add_argument("--weights", choices=WEIGHTS, default="bf16",
                      help="bf16, or mxfp8: every linear weight kept in fp8 (random e4m3 values + E8M0 scales)")
  parser.add_argument("--layers", type=int, default=None,
                      help="another depth (e.g. a 1-GPU run; with --smoke, a deep tiny model); default all 60")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--dry-run", action="store_true", help="lower + compile the sharded init only")
  parser.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the whole flow)")
  parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 8192; 64 with --smoke)")
  parser.add_argument("--concurrency", default="4,64")
  parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
  parser.add_argument("--timing", choices=("all", "loop"), default="all",
                      help="all: single synchronised steps, chained steps and the on-device loop; loop: the "
                           "on-device loop only (one compiled decode program per concurrency instead of two)")
  parser.add_argument("--fill", choices=("random", "prefill"), default="random", help="how decode caches are filled")
  parser.add_argument("--fill-batch", type=int, default=4, help="sequences per prefill call with --fill prefill")
  parser.add_argument("--skip-prefill", action="store_true", help="decode only")
  parser.add_argument("--prefill-last", action="store_true", help="time the prefill after the decode rows")
  parser.add_argument("--profile", action="store_true", help="GPU time per kernel of one decode step (CUPTI)")
  parser.add_argument("--no-balance-routing", action="store_true",
                      help="keep the random selection biases (random weights then route most tokens to the same "
                           "few experts; see balance_routing)")
  parser.add_argument("--balance-once", action="store_true",
                      help="calibrate the routing at the first concurrency only (the biases depend on the weights, "
                           "not the batch); later concurrencies keep them and report the uniform-routing roofline "
                           "only: one 60-layer compile less per concurrency")
  parser.add_argument("--copy-gib", type=float, default=2.0,
                      help="bf16 array size of the copy-bandwidth measurement (GiB; the roofline's bandwidth)")
  parser.add_argument("--dispatch-probe", action="store_true",
                      help="split a decode step's host time: no-op steps over the same arguments, flat or as pytrees")
  parser.add_argument("--stream-prompt", type=int, default=0, metavar="TOKENS",
                      help="also time m3jax.generate_stream per concurrency on prompts of this many random "
                           "tokens (about --decode-steps timed tokens each; 0 = off)")
  parser.add_argument("--stream-steps-per-call", default="1,4",
                      help="comma-separated generate_stream steps_per_call values to time with --stream-prompt")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option for the decode step's compilation (repeatable), e.g. "
                           "xla_gpu_dot_merger_threshold_mb=0")
  parser.add_argument("--loop-fusion-ab", action="store_true",
                      help="also time the on-device loop fusing the projection weights in every step (A/B)")
  parser.add_argument("--prefill-chunks", default="", metavar="N,N",
                      help="also time the prefill in chunks of these many tokens (generate's prefill_chunk) beside "
                           "the one-shot prefill, with each program's temporary (activation) memory from XLA")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.layout != "slices" and not args.one_shard:
    parser.error("--layout applies to --one-shard (a mesh run lays experts out by its sharding rules)")
  if args.timing == "loop" and (args.dispatch_probe or args.profile):
    parser.error("--dispatch-probe / --profile time the single-step program, which --timing loop does not build")
  return args


def plan_for(cfg: M3Config, full: M3Config, mesh, args, batch: int, context: int, dtype):
  """The per-device memory plan of this run (m3jax.parallel.memory), fp8 weights included; the ``experts``
  layout is the full model on a ``tensor=WAYS`` mesh (what one GPU of it holds)."""
  plan_cfg, plan_mesh = cfg, mesh
  if args.one_shard and args.layout == "experts":
    plan_cfg, plan_mesh = full, f"tensor={args.one_shard}"
  quantized = None
  if args.weights == "mxfp8":
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(plan_cfg, dtype=dtype))
    quantized = quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(abstract))])
  return plan_memory(plan_cfg, plan_mesh, batch=batch, context=context, dtype=dtype, quantized=quantized)


def main(argv=None) -> None:
  args = parse_args(argv)
  step_options = parse_compiler_options(args.compiler_option)

  full_cfg = model_config(args.layers, args.smoke)
  cfg = full_cfg
  full_text = cfg.text
  if args.one_shard:
    cfg = dataclasses.replace(cfg, text=shard_config(cfg.text, args.one_shard, args.layout))
  t = cfg.text
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  mesh = sharding.make_mesh("tensor=1" if args.one_shard else args.mesh)
  plan = sharding.ShardingPlan(mesh, sharding.RULES)
  sharding.check_config(cfg, mesh, plan.rules)
  # GPUs whose work one run stands for: the mesh, or the WAYS GPUs of the split one shard belongs to.
  n_gpus = args.one_shard or mesh.size
  prompt = args.prompt or (64 if args.smoke else 8192)
  concurrency = [int(c) for c in args.concurrency.split(",")]
  fp8 = args.weights == "mxfp8"
  # Room for the decode steps (timed twice, plus warm-ups) and for the routing calibration's tokens.
  cache_len = -(-(prompt + max(2 * args.decode_steps + 8, CALIBRATION_TOKENS)) // 128) * 128
  mem = plan_for(cfg, full_cfg, mesh, args, max(concurrency), cache_len, dtype)
  print(f"devices: {mesh.size} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; layers {t.num_layers}; "
        f"weights {args.weights}"
        + (f"; one GPU's shard of a {args.one_shard}-way split, experts as {args.layout}" if args.one_shard else ""))
  print("\n".join(mem.lines()))
  # A plan that cannot fit fails here, naming the sizes, instead of thrashing the allocator for minutes.
  mem.check_fits(device_limit(jax.devices()[0]), f"{t.num_layers} layers on {jax.devices()[0].device_kind}")

  # The roofline's bandwidth, measured before anything else holds memory.
  copy = copy_tbps(int(args.copy_gib * 2**30) if not args.smoke else 1 << 24)
  print(f"copy bandwidth (read + write): {copy:.2f} TB/s", flush=True)

  abstract, flat, keys, out_shardings, init = sharded_init(cfg, plan, args.kernels, dtype, args.weights,
                                                           args.layout, args.one_shard)
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
  random_params(flat, keys, out_shardings)
  jax.block_until_ready([var.get_value() for _, var in flat])
  model = nnx.merge(nnx.graphdef(abstract), nnx.from_flat_state(flat))
  model.sharding_plan = plan
  per_device = max(sharding.per_device_bytes(nnx.state(model)).values())
  print(f"sharded random init (compile included): {time.perf_counter() - start:.1f}s; per-device weight bytes "
        f"{per_device / 2**30:.2f} GiB", flush=True)
  graphdef, state = nnx.split(model)
  report: dict = {"mesh": dict(mesh.shape), "devices": mesh.size, "gpus_represented": n_gpus,
                  "one_shard_of": args.one_shard, "layout": args.layout if args.one_shard else None,
                  "weights": args.weights, "layers": t.num_layers, "parameters": n_params,
                  "device_kind": jax.devices()[0].device_kind, "fill": args.fill, "copy_TBps": copy,
                  "weight_bytes_per_device": per_device, "plan_total_per_device": mem.total_per_device,
                  "step_compiler_options": step_options, "timing": args.timing, "published": PUBLISHED}

  def save() -> None:
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

  save()

  @functools.partial(jax.jit, static_argnames=("cache_len", "chunk"))
  def prefill(state, ids, lengths, cache_len, chunk=None):
    return _prefill(nnx.merge(graphdef, state), ids, lengths, cache_len, chunk=chunk)

  def next_inputs(logits, pos, noise):
    """The next step's tokens and positions. The tokens depend on this step's logits (steps cannot overlap)
    but are spread over the vocabulary: greedy chains of random weights collapse onto repeated tokens, which
    touch fewer experts than real rows."""
    nxt = (jnp.argmax(logits, -1).astype(jnp.int32) + noise) % t.vocab_size
    return sharding.replicated(nxt, plan), sharding.replicated(pos + 1, plan)

  # Each layer's decode weights (projection weights fused) prepared once, as an m3jax.Decoder holds them for all
  # its steps (the step programs take them as arguments; params = (state, prepared)).
  prepared = jax.jit(lambda state: nnx.merge(graphdef, state).decode_weights())(state)
  workspace = sum(x.nbytes for x in jax.tree.leaves(prepared))
  print(f"decode-loop workspace (fused projection weights): {workspace / 2**30:.2f} GiB per device", flush=True)
  report["decode_workspace_bytes"] = workspace
  params = (state, prepared)

  @functools.partial(jax.jit, donate_argnames=("caches",), compiler_options=step_options)
  def chained_step(params, tok, pos, caches, noise):
    state, prepared = params
    logits, caches = _decode(nnx.merge(graphdef, state), tok, pos, caches, prepared)
    return (*next_inputs(logits, pos, noise), caches)

  @functools.partial(jax.jit, donate_argnames=("caches",), static_argnames=("fuse_per_step",),
                     compiler_options=step_options)
  def looped_steps(params, tok, pos, caches, noise, fuse_per_step=False):
    """len(noise) chained decode steps in one program (a lax.fori_loop, as ``m3jax.generate`` runs them):
    the host dispatches once, so per-call argument handling and launch costs are paid once. The steps use
    the pre-fused projection weights, or (``fuse_per_step``, the A/B baseline) fuse them in every step."""
    state, prepared = params
    model = nnx.merge(graphdef, state)
    prepared = None if fuse_per_step else prepared

    def body(i, carry):
      tok, pos, caches = carry
      logits, caches = _decode(model, tok, pos, caches, prepared)
      return (*next_inputs(logits, pos, noise[i]), caches)
    return jax.lax.fori_loop(0, noise.shape[0], body, (tok, pos, caches))

  put = functools.partial(sharding.put_replicated, plan=plan)

  def prefill_rows() -> None:
    ids = put(np.asarray(jax.random.randint(jax.random.key(0), (1, prompt), 0, t.vocab_size), np.int32))
    start = time.perf_counter()
    jax.block_until_ready(prefill(state, ids, put(np.asarray([prompt], np.int32)), cache_len))
    compile_s = time.perf_counter() - start
    ms = timed_ms(lambda: prefill(state, ids, put(np.asarray([prompt], np.int32)), cache_len)[0], repeats=3)
    report["prefill"] = {"ttft_ms": ms, "tok_s_per_gpu": prompt / ms * 1e3 / n_gpus, "first_call_s": compile_s}
    print(f"prefill {prompt} tokens: TTFT {ms:.1f} ms, {prompt / ms * 1e3 / n_gpus:.0f} tok/s per GPU "
          f"(first call, compile included: {compile_s:.1f}s)", flush=True)
    save()
    chunks = [int(v) for v in args.prefill_chunks.split(",") if v]
    if chunks:
      report["prefill_chunks"] = prefill_chunk_rows(prefill, state, ids, put(np.asarray([prompt], np.int32)),
                                                    cache_len, chunks)
      save()

  if not args.skip_prefill and not args.prefill_last:
    prefill_rows()

  # The routed experts one device holds in the ``experts`` layout (device 0's): the measured roofline counts
  # the experts of that range a batch touches.
  expert_range = (0, local_experts(t, args.one_shard)) if args.one_shard and args.layout == "experts" else None
  roofline = functools.partial(shard_weight_bytes, full_text, ways=n_gpus, fp8=fp8,
                               layout=args.layout if args.one_shard else "slices")
  calibrated = False
  for c in concurrency:
    start = time.perf_counter()
    if args.fill == "random":
      caches = random_caches(model, plan, c, cache_len)
    else:
      parts = []
      for lo in range(0, c, args.fill_batch):
        n = min(args.fill_batch, c - lo)
        batch_ids = put(np.asarray(jax.random.randint(jax.random.key(c + lo), (n, prompt), 0, t.vocab_size),
                                   np.int32))
        parts.append(prefill(state, batch_ids, put(np.full((n,), prompt, np.int32)), cache_len)[1])
      caches = jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *parts) if len(parts) > 1 else parts[0]
      del parts
    jax.block_until_ready(caches)
    fill_s = time.perf_counter() - start
    cache_bytes = max(sharding.per_device_bytes(caches).values())
    print(f"concurrency {c}: caches {cache_bytes / 2**30:.2f} GiB per device; weights + caches + decode workspace "
          f"{(per_device + cache_bytes + workspace) / 2**30:.2f} GiB", flush=True)
    balance = None
    measure_counts = not (args.balance_once and calibrated)
    if not args.no_balance_routing and not (args.balance_once and calibrated):
      begin = time.perf_counter()
      cal_len = -(-CALIBRATION_TOKENS // c)
      cal_tok = put(np.asarray(jax.random.randint(jax.random.key(7 + c), (c, cal_len), 0, t.vocab_size), np.int32))
      cal_pos = put(np.broadcast_to(prompt + np.arange(cal_len, dtype=np.int32), (c, cal_len)).copy())
      before, after, caches = balance_routing(model, cal_tok, cal_pos, caches)
      state = nnx.state(model)  # the calibrated selection biases
      params = (state, prepared)  # (biases change neither the fused attention weights nor the experts)
      balance = {"imbalance_before": statistics.mean(before), "imbalance_after": statistics.mean(after),
                 "calibration_tokens": c * cal_len, "seconds": time.perf_counter() - begin}
      calibrated = True
      print(f"routing balanced on {c * cal_len} tokens: busiest expert / mean load per MoE layer "
            f"{balance['imbalance_before']:.2f} -> {balance['imbalance_after']:.2f} ({balance['seconds']:.1f}s)",
            flush=True)
    tok = put(np.asarray(jax.random.randint(jax.random.key(c), (c,), 0, t.vocab_size), np.int32))
    pos = put(np.full((c,), prompt, np.int32))
    steps = args.decode_steps
    noise = put(np.asarray(jax.random.randint(jax.random.key(11), (2 * steps + 1, c), 0, t.vocab_size), np.int32))
    row: dict = {"fill_s": fill_s, "cache_bytes_per_device": cache_bytes, "routing_balance": balance}
    if args.timing == "all":
      begin = time.perf_counter()
      tok, pos, caches = chained_step(params, tok, pos, caches, noise[0])  # compile + warm
      jax.block_until_ready(tok)
      row["first_step_s"] = time.perf_counter() - begin
      # A second warm step: its inputs are step outputs, whose shardings may differ from the first inputs'.
      tok, pos, caches = chained_step(params, tok, pos, caches, noise[0])
      jax.block_until_ready(tok)
      times = []
      for i in range(steps):  # sync: the host waits for each step's token before dispatching the next
        begin = time.perf_counter()
        tok, pos, caches = chained_step(params, tok, pos, caches, noise[1 + i])
        tok.block_until_ready()
        times.append((time.perf_counter() - begin) * 1e3)
      row["tpot_sync_ms"] = statistics.median(times)
      begin = time.perf_counter()
      for i in range(steps):  # chained: dispatched back to back, one wait at the end
        tok, pos, caches = chained_step(params, tok, pos, caches, noise[1 + steps + i])
      row["dispatch_ms"] = (time.perf_counter() - begin) * 1e3 / steps  # host time per call, if never blocked
      jax.block_until_ready(tok)
      row["tpot_chained_ms"] = (time.perf_counter() - begin) * 1e3 / steps
    # On-device loop: compile + warm once, then time calls of `steps` steps (with --loop-fusion-ab, interleaved
    # with the baseline that fuses the projection weights in every step; medians of 3 calls each).
    variants = (False, True) if args.loop_fusion_ab else (False,)
    begin = time.perf_counter()
    for per_step in variants:
      tok, pos, caches = looped_steps(params, tok, pos, caches, noise[1:1 + steps], fuse_per_step=per_step)
      jax.block_until_ready(tok)
    row["looped_first_call_s"] = time.perf_counter() - begin
    loop_ms = {v: [] for v in variants}
    for _ in range(3 if args.loop_fusion_ab else 1):
      for per_step in variants:
        begin = time.perf_counter()
        tok, pos, caches = looped_steps(params, tok, pos, caches, noise[1 + steps:1 + 2 * steps],
                                        fuse_per_step=per_step)
        jax.block_until_ready(tok)
        loop_ms[per_step].append((time.perf_counter() - begin) * 1e3 / steps)
    looped = row["tpot_looped_ms"] = statistics.median(loop_ms[False])
    tpot = row.get("tpot_chained_ms", looped)  # the headline figure: chained steps, or the loop alone
    roof = roofline(c) / (copy * 1e12) * 1e3
    row.update(tok_s_per_gpu=c / tpot * 1e3 / n_gpus, roofline_ms=roof, roofline_ratio=tpot / roof,
               looped_roofline_ratio=looped / roof)
    # Random weights need not route uniformly: the roofline of the experts this batch actually touches (in the
    # ``experts`` layout, of this device's experts; a ``slices`` shard holds every expert at 1/WAYS of its width,
    # so the counts carry over to the full model).
    counts = None
    if measure_counts:
      counts, caches = routed_expert_counts(graphdef, state, tok, pos, caches, expert_range)
      routed_roof = roofline(c, counts=counts) / (copy * 1e12) * 1e3
      row.update(distinct_experts_mean=statistics.mean(counts) if counts else None, routed_roofline_ms=routed_roof,
                 looped_routed_roofline_ratio=looped / routed_roof)
    report[f"decode_c{c}"] = row
    if args.loop_fusion_ab:
      row["looped_fused_per_step_ms"] = statistics.median(loop_ms[True])
      row["looped_calls_ms"] = {"fused_once": loop_ms[False], "fused_per_step": loop_ms[True]}
    where = "of this device's experts " if expert_range else ""
    routed = (f"; x{looped / row['routed_roofline_ms']:.2f} of the {row['routed_roofline_ms']:.2f} ms roofline of the "
              f"{statistics.mean(counts) if counts else 0:.1f} experts {where}per layer this batch routes to"
              if counts is not None else "")
    chained = (f"TPOT {row['tpot_chained_ms']:.2f} ms chained, {row['tpot_sync_ms']:.2f} ms one step + sync "
               f"(x{row['tpot_chained_ms'] / roof:.2f}; host dispatch {row['dispatch_ms']:.2f} ms per call); "
               if args.timing == "all" else "")
    print(f"decode concurrency {c}: {chained}{looped:.2f} ms per step in an on-device loop of {steps} "
          f"(weight-read roofline {roof:.2f} ms at {copy:.2f} TB/s, x{looped / roof:.2f}{routed}), "
          f"{c / tpot * 1e3 / n_gpus:.0f} tok/s per GPU (cache fill {fill_s:.1f}s, first loop call with compile "
          f"{row['looped_first_call_s']:.1f}s)", flush=True)
    if args.loop_fusion_ab:
      print(f"decode concurrency {c} on-device loop, projection weights fused once per call vs in every step: "
            f"{looped:.3f} vs {statistics.median(loop_ms[True]):.3f} ms per step (calls: "
            f"{', '.join(f'{x:.3f}' for x in loop_ms[False])} vs {', '.join(f'{x:.3f}' for x in loop_ms[True])})",
            flush=True)
    if args.dispatch_probe:
      caches, probe = dispatch_probe(chained_step, graphdef, params, tok, pos, caches, noise[1:1 + steps])
      row["dispatch_probe"] = probe
      print(f"decode concurrency {c} dispatch probe (ms per call: host dispatch / chained / sync):",
            *(f"  {name}: {r['dispatch_ms']:.2f} / {r['chained_ms']:.2f} / {r['sync_ms']:.2f}"
              for name, r in probe.items()), sep="\n", flush=True)
    if args.profile and jax.default_backend() == "gpu" and c == concurrency[0]:
      from bench_generate import kernel_profile  # pylint: disable=g-import-not-at-top

      # The profiler calls the step more than once; the step donates its caches, so each call gets a copy
      # (the copies appear in the profile as their own launches).
      # Arguments, not closures: a closed-over state would be captured as ~100 GB of constants.
      prof = kernel_profile(lambda st, tk, ps, cs, nz: chained_step(st, tk, ps, jax.tree.map(jnp.copy, cs), nz),
                            params, tok, pos, caches, noise[0])
      row["profile"] = prof
      print(f"decode concurrency {c} profile: {prof['launches']} launches, {prof['gpu_us']} us of GPU time; by "
            "name (launches, us):", *(f"  {r}" for r in prof["by_name"]), sep="\n", flush=True)
    del caches
    for n in [int(v) for v in args.stream_steps_per_call.split(",") if v] if args.stream_prompt else []:
      stream = stream_tpot(model, c, args.stream_prompt, calls=max(4, -(-steps // n) + 2), steps_per_call=n)
      row[f"generate_stream_{n}"] = stream
      print(f"decode concurrency {c} generate_stream, {n} steps per call ({args.stream_prompt}-token prompts): "
            f"{stream['tpot_ms']:.2f} ms per token (slowest call {stream['call_ms_max']:.2f} ms; first prefill "
            f"{stream['prefill_first_call_s']:.1f}s)", flush=True)
    save()
  if not args.skip_prefill and args.prefill_last:
    prefill_rows()
  save()


if __name__ == "__main__":
  main()
