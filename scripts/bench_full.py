"""Full-size MiniMax M3 (all 60 layers, real dims) sharded over several GPUs: prefill and decode throughput.

Random bf16 weights are created directly in their shards (jitted per parameter shape: no host copy). Measures:
  * prefill: batch 1 x 8192-token prompt, time to first token and tokens/s per GPU;
  * decode: caches holding 8K-token contexts, then decode steps at concurrency 4 and 64: time per output token
    (TPOT) two ways -- the median of single steps, each synchronised with the host (sync), and the mean of
    --decode-steps steps dispatched back to back, each feeding the next (chained, as a serving loop or
    ``m3jax.generate``'s on-device loop runs them) -- and total output tokens/s per GPU;
next to the published H200 figures for the same model and the weight-read roofline (bf16 weights touched per
step / (GPUs x 4.3 TB/s)).

Decode caches are filled with random keys / values / index keys by default (--fill random): a decode step
reads the same bytes and selects the same number of blocks whatever the cached values, and a real prefill of
64 x 8K tokens costs minutes. --fill prefill prefills them from random prompts, --fill-batch sequences at a
time.

  8 GPUs:     PYTHONPATH=$PWD python3 scripts/bench_full.py --mesh tensor=8            (or expert=8, ...)
  one shard:  XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 PYTHONPATH=$PWD python3 scripts/bench_full.py --one-shard 8
              (one GPU: the work and memory of one GPU of an 8-way tensor-parallel split of the full model,
              all 60 layers -- see shard_config; no collectives, so a lower bound on the 8-GPU times)
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
from bench_common import timed_ms
from decode_analysis import balance_routing, decode_weight_bytes, dispatch_probe, routed_expert_counts, stream_tpot
from m3jax.model import M3ForCausalLM
from m3jax.checkpoint.fit import device_limit
from m3jax.parallel.memory import plan_memory

COPY_TBPS = 4.3
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


def shard_config(text: TextConfig, ways: int) -> TextConfig:
  """The model one GPU computes in a ``ways``-way tensor-parallel split of ``text`` (as SGLang's TP8 splits M3).

  Query heads, the dense / shared MLP widths, each routed expert's width and the vocabulary are divided by
  ``ways``; KV and index heads too, with at least one per GPU (more ranks than KV heads replicate them, as
  vLLM and m3jax.sharding do). Every routed expert stays (1/ways of each), so a decode step reads 1/ways of the
  expert bytes the full model reads; m3jax's own meshes place whole experts instead (expert parallelism),
  which reads the same bytes per GPU in expectation. Raises ValueError naming any width ``ways`` does not divide.
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
  return dataclasses.replace(
      text, num_heads=split("num_heads"), num_kv_heads=kv, index_num_heads=kv,
      intermediate_size=split("intermediate_size"), shared_intermediate_size=split("shared_intermediate_size"),
      dense_intermediate_size=split("dense_intermediate_size"), vocab_size=split("vocab_size"))


def sharded_init(cfg: M3Config, plan: sharding.ShardingPlan, kernels: str, dtype):
  """(abstract model, its flat state, the state's keys, their shardings, a jitted init of the whole model).

  The whole-model init (one jit with out_shardings) is what --dry-run lowers; a run fills the parameters leaf by
  leaf instead (random_params): one jit compiles 60 layers of initialisers very slowly (over 6 minutes for the
  full model on the GPU host), while per-leaf jits compile once per distinct shape.
  """
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=kernels))
  flat = list(nnx.to_flat_state(nnx.state(abstract)))
  keys = ["/".join(map(str, path)) for path, _ in flat]
  out_shardings = {k: plan.sharding(sharding.logical_axes_of(var), var.shape) for k, (_, var) in zip(keys, flat)}

  @functools.partial(jax.jit, out_shardings=out_shardings)
  def init():
    model = M3ForCausalLM(cfg, dtype=dtype, kernels=kernels, rngs=nnx.Rngs(0))
    return {k: var.get_value() for k, (_, var) in zip(keys, nnx.to_flat_state(nnx.state(model)))}

  return abstract, flat, keys, out_shardings, init


@functools.lru_cache(maxsize=None)
def _normal_leaf(shape: tuple[int, ...], dtype: jnp.dtype, out_sharding, std: float = 0.02) -> object:
  """A jitted key -> N(0, std^2) array of shape / dtype created directly in out_sharding (std 0.02: make_param's
  init)."""
  return jax.jit(lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype),
                 out_shardings=out_sharding)


def random_params(flat, keys, out_shardings, seed: int = 0) -> None:
  """Sets every abstract parameter of ``flat`` to random N(0, 0.02^2) values in its sharding (no host copy)."""
  base = jax.random.key(seed)
  for i, ((_, var), k) in enumerate(zip(flat, keys)):
    var.set_value(_normal_leaf(tuple(var.shape), jnp.dtype(var.dtype), out_shardings[k])(jax.random.fold_in(base, i)))


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mesh", default="tensor=8", help="e.g. tensor=8, expert=8, expert=4,tensor=2")
  parser.add_argument("--one-shard", type=int, default=None, metavar="WAYS",
                      help="run one GPU's share of a WAYS-way tensor-parallel split on one device (shard_config)")
  parser.add_argument("--layers", type=int, default=None,
                      help="another depth (e.g. a 1-GPU run; with --smoke, a deep tiny model); default all 60")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--dry-run", action="store_true", help="lower + compile the sharded init only")
  parser.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the whole flow)")
  parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 8192; 64 with --smoke)")
  parser.add_argument("--concurrency", default="4,64")
  parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
  parser.add_argument("--fill", choices=("random", "prefill"), default="random", help="how decode caches are filled")
  parser.add_argument("--fill-batch", type=int, default=4, help="sequences per prefill call with --fill prefill")
  parser.add_argument("--skip-prefill", action="store_true", help="decode only")
  parser.add_argument("--profile", action="store_true", help="GPU time per kernel of one decode step (CUPTI)")
  parser.add_argument("--no-balance-routing", action="store_true",
                      help="keep the random selection biases (random weights then route most tokens to the same "
                           "few experts; see balance_routing)")
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
  args = parser.parse_args()
  step_options = parse_compiler_options(args.compiler_option)

  cfg = model_config(args.layers, args.smoke)
  full_text = cfg.text
  if args.one_shard:
    cfg = dataclasses.replace(cfg, text=shard_config(cfg.text, args.one_shard))
  t = cfg.text
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  mesh = sharding.make_mesh("tensor=1" if args.one_shard else args.mesh)
  plan = sharding.ShardingPlan(mesh, sharding.RULES)
  sharding.check_config(cfg, mesh, plan.rules)
  # GPUs whose work one run stands for: the mesh, or the WAYS GPUs of the split one shard belongs to.
  n_gpus = args.one_shard or mesh.size
  prompt = args.prompt or (64 if args.smoke else 8192)
  concurrency = [int(c) for c in args.concurrency.split(",")]
  mem = plan_memory(cfg, mesh, batch=max(concurrency), context=prompt + 1024, dtype=dtype)
  print(f"devices: {mesh.size} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; layers {t.num_layers}"
        + (f"; one GPU's shard of a {args.one_shard}-way tensor-parallel split" if args.one_shard else ""))
  print("\n".join(mem.lines()))
  # A plan that cannot fit fails here, naming the sizes, instead of thrashing the allocator for minutes.
  mem.check_fits(device_limit(jax.devices()[0]), f"{t.num_layers} layers on {jax.devices()[0].device_kind}")

  abstract, flat, keys, out_shardings, init = sharded_init(cfg, plan, args.kernels, dtype)
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
  print(f"sharded random init (compile included): {time.perf_counter() - start:.1f}s; per-device bytes "
        f"{per_device / 2**30:.1f} GiB", flush=True)
  graphdef, state = nnx.split(model)
  report: dict = {"mesh": dict(mesh.shape), "devices": mesh.size, "gpus_represented": n_gpus,
                  "one_shard_of": args.one_shard, "layers": t.num_layers, "parameters": n_params,
                  "device_kind": jax.devices()[0].device_kind, "fill": args.fill,
                  "step_compiler_options": step_options, "published": PUBLISHED}

  def save() -> None:
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

  # Room for the decode steps (timed twice, plus warm-ups) and for the routing calibration's tokens.
  cache_len = -(-(prompt + max(2 * args.decode_steps + 8, CALIBRATION_TOKENS)) // 128) * 128

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
  if not args.skip_prefill:
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
    balance = None
    if not args.no_balance_routing:
      begin = time.perf_counter()
      cal_len = -(-CALIBRATION_TOKENS // c)
      cal_tok = put(np.asarray(jax.random.randint(jax.random.key(7 + c), (c, cal_len), 0, t.vocab_size), np.int32))
      cal_pos = put(np.broadcast_to(prompt + np.arange(cal_len, dtype=np.int32), (c, cal_len)).copy())
      before, after, caches = balance_routing(model, cal_tok, cal_pos, caches)
      state = nnx.state(model)  # the calibrated selection biases
      params = (state, prepared)  # (biases change neither the fused attention weights nor the experts)
      balance = {"imbalance_before": statistics.mean(before), "imbalance_after": statistics.mean(after),
                 "calibration_tokens": c * cal_len, "seconds": time.perf_counter() - begin}
      print(f"routing balanced on {c * cal_len} tokens: busiest expert / mean load per MoE layer "
            f"{balance['imbalance_before']:.2f} -> {balance['imbalance_after']:.2f} ({balance['seconds']:.1f}s)",
            flush=True)
    tok = put(np.asarray(jax.random.randint(jax.random.key(c), (c,), 0, t.vocab_size), np.int32))
    pos = put(np.full((c,), prompt, np.int32))
    steps = args.decode_steps
    noise = put(np.asarray(jax.random.randint(jax.random.key(11), (2 * steps + 1, c), 0, t.vocab_size), np.int32))
    begin = time.perf_counter()
    tok, pos, caches = chained_step(params, tok, pos, caches, noise[0])  # compile + warm
    jax.block_until_ready(tok)
    first_s = time.perf_counter() - begin
    # A second warm step: its inputs are step outputs, whose shardings may differ from the first inputs'.
    tok, pos, caches = chained_step(params, tok, pos, caches, noise[0])
    jax.block_until_ready(tok)
    times = []
    for i in range(steps):  # sync: the host waits for each step's token before dispatching the next
      begin = time.perf_counter()
      tok, pos, caches = chained_step(params, tok, pos, caches, noise[1 + i])
      tok.block_until_ready()
      times.append((time.perf_counter() - begin) * 1e3)
    sync = statistics.median(times)
    begin = time.perf_counter()
    for i in range(steps):  # chained: dispatched back to back, one wait at the end
      tok, pos, caches = chained_step(params, tok, pos, caches, noise[1 + steps + i])
    dispatch = (time.perf_counter() - begin) * 1e3 / steps  # host time per call, if the queue never blocks
    jax.block_until_ready(tok)
    chained = (time.perf_counter() - begin) * 1e3 / steps
    # On-device loop: compile + warm once, then time calls of `steps` steps (with --loop-fusion-ab, interleaved
    # with the baseline that fuses the projection weights in every step; medians of 3 calls each).
    variants = (False, True) if args.loop_fusion_ab else (False,)
    begin = time.perf_counter()
    for per_step in variants:
      tok, pos, caches = looped_steps(params, tok, pos, caches, noise[1:1 + steps], fuse_per_step=per_step)
      jax.block_until_ready(tok)
    loop_first_s = time.perf_counter() - begin
    loop_ms = {v: [] for v in variants}
    for _ in range(3 if args.loop_fusion_ab else 1):
      for per_step in variants:
        begin = time.perf_counter()
        tok, pos, caches = looped_steps(params, tok, pos, caches, noise[1 + steps:1 + 2 * steps],
                                        fuse_per_step=per_step)
        jax.block_until_ready(tok)
        loop_ms[per_step].append((time.perf_counter() - begin) * 1e3 / steps)
    looped = statistics.median(loop_ms[False])
    roof = decode_weight_bytes(full_text, c) / (n_gpus * COPY_TBPS * 1e12) * 1e3
    # Random weights need not route uniformly: the roofline of the experts this batch actually touches.
    counts, caches = routed_expert_counts(graphdef, state, tok, pos, caches)
    # A shard holds every expert at 1/WAYS of its width, so the counts carry over to the full model.
    routed_roof = decode_weight_bytes(full_text, c, counts) / (n_gpus * COPY_TBPS * 1e12) * 1e3
    report[f"decode_c{c}"] = {"tpot_sync_ms": sync, "tpot_chained_ms": chained, "dispatch_ms": dispatch,
                              "tpot_looped_ms": looped, "looped_first_call_s": loop_first_s,
                              "tok_s_per_gpu": c / chained * 1e3 / n_gpus, "roofline_ms": roof,
                              "roofline_ratio": chained / roof, "fill_s": fill_s,
                              "distinct_experts_mean": statistics.mean(counts) if counts else None,
                              "routing_balance": balance,
                              "routed_roofline_ms": routed_roof, "looped_routed_roofline_ratio": looped / routed_roof,
                              "first_step_s": first_s}
    if args.loop_fusion_ab:
      report[f"decode_c{c}"]["looped_fused_per_step_ms"] = statistics.median(loop_ms[True])
      report[f"decode_c{c}"]["looped_calls_ms"] = {"fused_once": loop_ms[False], "fused_per_step": loop_ms[True]}
    print(f"decode concurrency {c}: TPOT {chained:.2f} ms chained, {sync:.2f} ms one step + sync (weight-read "
          f"roofline {roof:.2f} ms, x{chained / roof:.2f}; host dispatch {dispatch:.2f} ms per call); {looped:.2f} ms "
          f"per step in an on-device loop of {steps} (x{looped / roof:.2f}; x{looped / routed_roof:.2f} of the "
          f"{routed_roof:.2f} ms roofline of the {statistics.mean(counts) if counts else 0:.1f} experts per layer "
          f"this batch routes to), "
          f"{c / chained * 1e3 / n_gpus:.0f} tok/s per GPU "
          f"(cache fill {fill_s:.1f}s, first step with compile {first_s:.1f}s)", flush=True)
    if args.loop_fusion_ab:
      print(f"decode concurrency {c} on-device loop, projection weights fused once per call vs in every step: "
            f"{looped:.3f} vs {statistics.median(loop_ms[True]):.3f} ms per step (calls: "
            f"{', '.join(f'{x:.3f}' for x in loop_ms[False])} vs {', '.join(f'{x:.3f}' for x in loop_ms[True])})",
            flush=True)
    if args.dispatch_probe:
      caches, probe = dispatch_probe(chained_step, graphdef, params, tok, pos, caches, noise[1:1 + steps])
      report[f"decode_c{c}"]["dispatch_probe"] = probe
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
      report[f"decode_c{c}"]["profile"] = prof
      print(f"decode concurrency {c} profile: {prof['launches']} launches, {prof['gpu_us']} us of GPU time; by "
            "name (launches, us):", *(f"  {row}" for row in prof["by_name"]), sep="\n", flush=True)
    del caches
    for n in [int(v) for v in args.stream_steps_per_call.split(",") if v] if args.stream_prompt else []:
      stream = stream_tpot(model, c, args.stream_prompt, calls=max(4, -(-steps // n) + 2), steps_per_call=n)
      report[f"decode_c{c}"][f"generate_stream_{n}"] = stream
      print(f"decode concurrency {c} generate_stream, {n} steps per call ({args.stream_prompt}-token prompts): "
            f"{stream['tpot_ms']:.2f} ms per token (slowest call {stream['call_ms_max']:.2f} ms; first prefill "
            f"{stream['prefill_first_call_s']:.1f}s)", flush=True)
    save()
  save()


if __name__ == "__main__":
  main()
