"""Serving benchmarks of the paged engine (m3jax.engine.Engine, #49) against the slot engine it replaced
(scripts/slot_engine.py, the same run), on bench_generate's real-dims M3 slice (embeddings, LM head and 4 layers: 1
dense, 3 sparse + MoE) with random bf16 weights. Random weights never stop on their own: each request's budget
(max_new_tokens) plays the part of a stop token. Every section runs its workload once to compile and once timed.

Sections (--sections, all by default):
  throughput  the same cache memory for both engines (slots x max_length tokens): the slot engine runs --slots
              requests at once, the paged engine up to --max-seqs, on --requests requests whose prompt lengths are
              log-uniform in --prompt-range and whose budgets are uniform in --budget-range (seed 0). Reported:
              useful (generated) tokens per second of each and their ratio; greedy tokens of the first requests
              compared between the engines. Target: ratio >= 1.5.
  prefix      TTFT of a request whose prompt is a --prefix-tokens prefix + 16 tokens, then of a second request
              with the same prefix and 16 other tokens (read from the prefix cache). Target: second <= 15 % first.
  long_prompt --runners requests decoding; a --long-tokens prompt arrives mid-run. Reported: the runners' time per
              output token (TPOT: time over tokens) before it arrives and while it is prefilled, for the
              paged engine (chunked prefill, at each of --long-prefill-chunks tokens per step) and the slot engine
              (one whole prefill). Target: paged ratio <= 2 at the engine's budget (--prefill-chunk).
  attention   one sparse layer's decode attention (indexer + block-sparse attention) and one full layer's causal
              attention, batch --attn-batch at --attn-context tokens, over page pools with shuffled page tables
              against contiguous caches (the ops the model runs: Pallas kernels on the GPU). Target: paged <= 1.1x.

  GPU:        PYTHONPATH=$PWD python3 scripts/bench_serving.py --out $OUT/serving.json
  CPU smoke:  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 scripts/bench_serving.py --smoke --out /tmp/serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench_common import timed_ms
from bench_generate import slice_config
from m3jax.engine import Engine
from m3jax.model import M3ForCausalLM
from m3jax.ops import attention as attention_ops
from m3jax.ops import indexer as indexer_ops
from slot_engine import SlotEngine

TARGETS = {"throughput_ratio_min": 1.5, "prefix_ttft_ratio_max": 0.15, "long_prompt_tpot_ratio_max": 2.0,
           "paged_attention_ratio_max": 1.1}


def workload(n: int, prompt_range: tuple[int, int], budget_range: tuple[int, int], vocab: int, seed: int
             ) -> list[tuple[list[int], int]]:
  """n (prompt ids, max_new_tokens): prompt lengths log-uniform in [lo, hi], budgets uniform in [lo, hi]."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    length = int(round(np.exp(rng.uniform(np.log(prompt_range[0]), np.log(prompt_range[1])))))
    out.append((rng.integers(0, vocab, length).tolist(), int(rng.integers(budget_range[0], budget_range[1] + 1))))
  return out


def _emit(result: dict, key: str, value: dict) -> None:
  result[key] = value
  print(json.dumps({key: value}), flush=True)


def _serve(engine, requests) -> tuple[float, dict]:
  for i, (p, n) in enumerate(requests):
    engine.submit(p, max_new_tokens=n, request_id=i)
  start = time.perf_counter()
  done = {c.request_id: c.tokens.tolist() for c in engine.run()}
  return time.perf_counter() - start, done


def throughput(model, args, result) -> None:
  vocab = model.config.text.vocab_size
  requests = workload(args.requests, args.prompt_range, args.budget_range, vocab, seed=0)
  max_length = args.prompt_range[1] + args.budget_range[1]
  useful = sum(n for _, n in requests)
  memory = args.slots * -(-max_length // model.config.text.index_block_size) * model.config.text.index_block_size
  out = {"requests": len(requests), "prompt_range_log_uniform": args.prompt_range,
         "budget_range_uniform": args.budget_range, "useful_tokens": useful, "cache_tokens": memory}
  outputs = {}
  for name in ("slot", "paged"):
    def make():
      if name == "slot":
        return SlotEngine(model, slots=args.slots, max_length=max_length, eos_token_ids=(),
                          steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk)
      return Engine(model, max_seqs=args.max_seqs, max_tokens_in_cache=memory, max_length=max_length,
                    eos_token_ids=(), steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk)
    _serve(make(), requests)  # compiles
    engine = make()
    seconds, outputs[name] = _serve(engine, requests)
    out[name] = {"seconds": seconds, "useful_tok_s": useful / seconds, "decode_calls": engine.decode_calls}
    if name == "paged":
      out[name]["preemptions"] = engine.preemptions
  out["ratio"] = out["paged"]["useful_tok_s"] / out["slot"]["useful_tok_s"]
  checked = range(min(args.check, len(requests)))
  out["check_equal"] = [outputs["paged"][i] == outputs["slot"][i] for i in checked]
  _emit(result, "throughput", out)


def _ttft(engine, prompt: list[int]) -> float:
  engine.submit(prompt, max_new_tokens=1, request_id="r")
  start = time.perf_counter()
  for _ in engine.stream():
    return time.perf_counter() - start
  raise RuntimeError("no token")


def prefix(model, args, result) -> None:
  vocab = model.config.text.vocab_size
  rng = np.random.default_rng(1)
  engine = Engine(model, max_seqs=2, max_tokens_in_cache=4 * (args.prefix_tokens + 64), eos_token_ids=(),
                  steps_per_call=1, prefill_chunk=args.prefill_chunk)
  times = []
  for _ in range(2):  # the first pass compiles (its prefix differs from the second's: no hits across passes)
    shared = rng.integers(0, vocab, args.prefix_tokens).tolist()
    times = [_ttft(engine, shared + rng.integers(0, vocab, 16).tolist()) for _ in range(2)]
    list(engine.run())  # drains the requests' one-call-late tokens
  stats = engine.stats()
  out = {"prefix_tokens": args.prefix_tokens, "first_ttft_s": times[0], "second_ttft_s": times[1],
         "ratio": times[1] / times[0], "prefix_hit_tokens": stats.prefix_hit_tokens}
  _emit(result, "prefix", out)


def _runner_tpot(engine, runners, long_prompt: list[int], arrive_after: int) -> dict:
  """Submits ``runners``, then ``long_prompt`` once runner 0 has ``arrive_after`` tokens. Runner 0's time per
  output token (all runners decode in the same calls): the mean (seconds between its updates over their tokens)
  before the long prompt arrives and from its arrival until its first token, and the longest gap between two of
  runner 0's updates in that window (a stall)."""
  for i, (p, n) in enumerate(runners):
    engine.submit(p, max_new_tokens=n, request_id=i)
  before, during = [], []  # (seconds, tokens) between runner 0's consecutive updates
  last = None
  count = 0
  arrived = long_done = False
  for update in engine.stream():
    now = time.perf_counter()
    if update.request_id == "long":
      long_done = True
      for i in range(len(runners)):  # measured: the rest of their tokens would only cost time
        engine.cancel(i)
      continue
    n = len(update.new_tokens)
    if update.request_id != 0 or not n:
      continue
    if last is not None and not long_done:
      (during if arrived else before).append((now - last, n))
    last = now
    count += n
    if not arrived and count >= arrive_after:
      engine.submit(long_prompt, max_new_tokens=1, request_id="long")
      arrived = True

  def mean(gaps):
    return sum(t for t, _ in gaps) / sum(n for _, n in gaps) if gaps else None

  return {"before_s": mean(before), "during_s": mean(during), "during_updates": len(during),
          "stall_s": max((t for t, _ in during), default=None)}


def long_prompt(model, args, result) -> None:
  vocab = model.config.text.vocab_size
  rng = np.random.default_rng(2)
  runners = [(rng.integers(0, vocab, args.runner_prompt).tolist(), args.runner_tokens) for _ in range(args.runners)]
  long = rng.integers(0, vocab, args.long_tokens).tolist()
  max_length = args.long_tokens + 16
  out = {"runners": args.runners, "long_tokens": args.long_tokens, "prefill_chunk": args.prefill_chunk,
         "paged_chunks": args.long_prefill_chunks}
  runs = [("slot", args.prefill_chunk)] + [(f"paged_chunk{c}", c) for c in args.long_prefill_chunks]
  for name, chunk in runs:
    def make():
      if name == "slot":
        return SlotEngine(model, slots=args.runners + 1, max_length=max_length, eos_token_ids=(),
                          steps_per_call=args.steps_per_call, prefill_chunk=chunk)
      cache = args.runners * (args.runner_prompt + args.runner_tokens + 256) + max_length
      return Engine(model, max_seqs=args.runners + 1, max_tokens_in_cache=cache, max_length=max_length,
                    eos_token_ids=(), steps_per_call=args.steps_per_call, prefill_chunk=chunk)
    _runner_tpot(make(), runners, long, args.arrive_after)  # compiles
    tpot = _runner_tpot(make(), runners, long, args.arrive_after)
    tpot["ratio"] = None if tpot["during_s"] is None else tpot["during_s"] / tpot["before_s"]
    out[name] = tpot
  # The engine's default budget (--prefill-chunk) is what the target is judged on.
  out["paged"] = out[f"paged_chunk{args.prefill_chunk}"]
  _emit(result, "long_prompt", out)


def attention(model, args, result) -> None:
  cfg = model.config.text
  b, ctx, page = args.attn_batch, args.attn_context, cfg.index_block_size
  n = ctx // page
  keys = jax.random.split(jax.random.key(3), 6)
  dtype = model.dtype
  q = jax.random.normal(keys[0], (b, 1, cfg.num_heads, cfg.head_dim)).astype(dtype)
  k = jax.random.normal(keys[1], (b, ctx, cfg.num_kv_heads, cfg.head_dim)).astype(dtype)
  v = jax.random.normal(keys[2], (b, ctx, cfg.num_kv_heads, cfg.head_dim)).astype(dtype)
  idx_q = jax.random.normal(keys[3], (b, 1, cfg.index_num_heads, cfg.index_head_dim)).astype(dtype)
  idx_k = jax.random.normal(keys[4], (b, ctx, cfg.index_head_dim)).astype(dtype)
  positions = jnp.full((b, 1), ctx - 1, jnp.int32)
  # The pool holds every sequence's pages at shuffled places (as after a while of serving).
  table = jnp.asarray(np.random.default_rng(4).permutation(b * n).reshape(b, n), jnp.int32)
  inverse = jnp.argsort(table.reshape(-1))

  def pool(x):
    return x.reshape(b * n, page, *x.shape[2:])[inverse]

  k_pool, v_pool, idx_pool = pool(k), pool(v), pool(idx_k)
  kernels = args.kernels
  sel = dict(block_size=page, topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
             init_blocks=cfg.index_init_blocks, kernels=kernels)
  scale = cfg.head_dim ** -0.5

  @jax.jit
  def sparse(q, k, v, idx_q, idx_k, positions, table):
    paged = None if table.shape[0] == 0 else table
    ids = indexer_ops.indexer_topk(idx_q, idx_k, positions, page_table=paged, **sel)
    return attention_ops.sparse_attention(q, k, v, ids, positions, block_size=page, scale=scale, kernels=kernels,
                                          page_table=paged)

  @jax.jit
  def causal(q, k, v, positions, table):
    paged = None if table.shape[0] == 0 else table
    return attention_ops.causal_attention(q, k, v, positions, scale=scale, kernels=kernels, page_table=paged)

  none = jnp.zeros((0, n), jnp.int32)
  contiguous_out = sparse(q, k, v, idx_q, idx_k, positions, none)
  paged_out = sparse(q, k_pool, v_pool, idx_q, idx_pool, positions, table)
  out = {"batch": b, "context": ctx, "page_size": page, "kernels": kernels,
         "max_abs_diff": float(jnp.max(jnp.abs(contiguous_out.astype(jnp.float32) - paged_out.astype(jnp.float32))))}
  reps = args.reps
  for name, fn, contiguous, paged in (
      ("sparse_layer", sparse, (q, k, v, idx_q, idx_k, positions, none),
       (q, k_pool, v_pool, idx_q, idx_pool, positions, table)),
      ("full_layer", causal, (q, k, v, positions, none), (q, k_pool, v_pool, positions, table))):
    t_contiguous, t_paged = (timed_ms(fn, *contiguous, repeats=reps) / 1e3,
                            timed_ms(fn, *paged, repeats=reps) / 1e3)
    out[name] = {"contiguous_s": t_contiguous, "paged_s": t_paged, "ratio": t_paged / t_contiguous}
  _emit(result, "attention", out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny dims and workloads (CPU check of the whole flow)")
  parser.add_argument("--sections", default="throughput,prefix,long_prompt,attention")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--steps-per-call", type=int, default=4)
  parser.add_argument("--prefill-chunk", type=int, default=2048)
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--slots", type=int, default=8, help="the slot engine's slots")
  parser.add_argument("--max-seqs", type=int, default=32, help="the paged engine's decode batch")
  parser.add_argument("--prompt-range", default="128,4096")
  parser.add_argument("--budget-range", default="32,512")
  parser.add_argument("--check", type=int, default=4, help="requests whose tokens are compared between engines")
  parser.add_argument("--prefix-tokens", type=int, default=4096)
  parser.add_argument("--runners", type=int, default=8)
  parser.add_argument("--runner-prompt", type=int, default=256)
  parser.add_argument("--runner-tokens", type=int, default=512)
  parser.add_argument("--long-tokens", type=int, default=32768)
  parser.add_argument("--arrive-after", type=int, default=64, help="runner tokens before the long prompt arrives")
  parser.add_argument("--long-prefill-chunks", default="512,1024,2048",
                      help="the paged engine's prefill budgets tried in long_prompt (--prefill-chunk among them)")
  parser.add_argument("--attn-batch", type=int, default=32)
  parser.add_argument("--attn-context", type=int, default=8192)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  if args.smoke:
    args.requests, args.slots, args.max_seqs = min(args.requests, 6), 2, 4
    args.prompt_range, args.budget_range, args.prefill_chunk = "8,30", "2,12", 32
    args.prefix_tokens, args.runners, args.runner_prompt, args.runner_tokens = 64, 2, 16, 64
    args.long_tokens, args.arrive_after, args.attn_batch, args.attn_context, args.reps = 96, 12, 2, 128, 2
    args.check = min(args.check, 6)
  if args.smoke:
    args.long_prefill_chunks = "16,32"
  args.long_prefill_chunks = sorted({int(x) for x in args.long_prefill_chunks.split(",")} | {args.prefill_chunk})
  args.prompt_range = tuple(int(x) for x in args.prompt_range.split(","))
  args.budget_range = tuple(int(x) for x in args.budget_range.split(","))
  cfg = slice_config(args.smoke)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  model = nnx.jit(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=args.kernels, rngs=nnx.Rngs(0)))()
  result = {"device": str(jax.devices()[0]), "targets": TARGETS, "steps_per_call": args.steps_per_call,
            "prefill_chunk": args.prefill_chunk}
  sections = {"throughput": throughput, "prefix": prefix, "long_prompt": long_prompt, "attention": attention}
  for name in args.sections.split(","):
    if name:
      sections[name](model, args, result)
  met = {}
  if "throughput" in result:
    met["throughput"] = result["throughput"]["ratio"] >= TARGETS["throughput_ratio_min"]
  if "prefix" in result:
    met["prefix"] = result["prefix"]["ratio"] <= TARGETS["prefix_ttft_ratio_max"]
  if "long_prompt" in result and result["long_prompt"]["paged"]["ratio"] is not None:
    met["long_prompt"] = result["long_prompt"]["paged"]["ratio"] <= TARGETS["long_prompt_tpot_ratio_max"]
  if "attention" in result:
    met["attention"] = max(result["attention"][k]["ratio"] for k in ("sparse_layer", "full_layer")) <= \
        TARGETS["paged_attention_ratio_max"]
  result["targets_met"] = met
  print(json.dumps({"targets_met": met}), flush=True)
  if args.out:
    with open(args.out + ".tmp", "w") as f:
      json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
  main()
