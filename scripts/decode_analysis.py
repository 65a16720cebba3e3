"""Decode-step analysis helpers for scripts/bench_full.py: the weight-read roofline of the experts a batch
touches, the routing of random-weight models (measured, and balanced like a trained selection bias), and a
probe that splits a jitted decode step's host time into argument handling and launch."""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.config import TextConfig
from m3jax.generate import generate_stream
from m3jax.model import M3ForCausalLM
from m3jax.research import Collect


def decode_weight_bytes(t: TextConfig, batch: int, distinct_experts: list[float] | None = None) -> float:
  """bf16 weights one decode step reads, all GPUs together: the experts each MoE layer touches are
  ``distinct_experts`` (one count per MoE layer, e.g. measured by routed_expert_counts) or, by default, the
  expected number of distinct experts under uniform routing."""
  h = t.hidden_size
  attn = h * (2 * t.num_heads * t.head_dim + 2 * t.num_kv_heads * t.head_dim)
  idx = h * (t.index_num_heads + 1) * t.index_head_dim
  uniform = t.num_experts * (1 - (1 - t.num_experts_per_tok / t.num_experts) ** batch)
  counts = iter(distinct_experts) if distinct_experts is not None else None
  total = h * t.vocab_size
  for kind, mlp in zip(t.attention_types, t.mlp_types):
    total += attn + (idx if kind == "sparse" else 0)
    if mlp == "dense":
      total += 3 * h * t.dense_intermediate_size
    else:
      distinct = uniform if counts is None else next(counts)
      total += 3 * h * (t.shared_intermediate_size + distinct * t.intermediate_size)
  return 2 * total


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("caches",))
def _routing_stats(graphdef, state, tok, pos, caches):
  """One forward of tok int32 [B, S] at positions pos [B, S] with the routing recorded -> (per MoE layer: mean
  sigmoid score per expert fp32 [n_moe, E], picks per expert fp32 [n_moe, E]; the caches, donated)."""
  out = nnx.merge(graphdef, state).forward(tok, positions=pos, caches=caches, collect=Collect(routing=True))
  means, loads = [], []
  for record in out.intermediates:
    if "expert_ids" in record:
      logits = record["router_logits"]
      means.append(jnp.mean(jax.nn.sigmoid(logits), axis=(0, 1)))
      loads.append(jnp.zeros(logits.shape[-1:], jnp.float32).at[record["expert_ids"].reshape(-1)].add(1.0))
  return jnp.stack(means), jnp.stack(loads), out.caches


def routed_expert_counts(graphdef, state, tok, pos, caches, expert_range: tuple[int, int] | None = None
                         ) -> tuple[list[int], tuple]:
  """(distinct experts each MoE layer routes this decode batch (tok, pos int32 [B]) to -- among experts
  [lo, hi) when ``expert_range`` is given (one device's experts) --, the caches): one decode forward with the
  routing recorded; the caches are donated and returned (updated at ``pos``, as the next step would)."""
  _, loads, caches = _routing_stats(graphdef, state, tok[:, None], pos[:, None], caches)
  loads = np.asarray(loads)
  if expert_range is not None:
    loads = loads[:, expert_range[0]:expert_range[1]]
  return [int(n) for n in (loads > 0).sum(-1)], caches


def balance_routing(model: M3ForCausalLM, tok, pos, caches, passes: int = 2
                    ) -> tuple[list[float], list[float], tuple]:
  """Sets each MoE layer's selection bias (``correction_bias``) to minus its experts' mean sigmoid score over a
  calibration batch, as the trained bias does (M3 balances expert load with it). Random weights otherwise
  route most tokens to the same few experts: on the H200, 8.8 / 31.0 distinct experts per layer at
  concurrency 4 / 64, where uniform routing gives 15.1 / 111.2 (BENCHMARKS.md).

  tok, pos: int32 [B, S] tokens written at cache positions pos (later decode steps overwrite those slots before
  any query reads them); caches are donated and returned. Each pass recentres every layer on the routing the
  previous pass produced upstream. Returns (load imbalance per MoE layer before and after: the busiest
  expert's share of the calibration batch's picks over the mean share; 1 = perfectly even), caches).

  The S columns run as S decode-shaped forwards ([B, 1] each, one after the other), so the calibration shares
  its compiled program with ``routed_expert_counts`` (a 60-layer forward takes ~40 s to compile on the GPU
  host); the statistics are the same as one [B, S] forward's up to the attention of column j seeing the
  calibration tokens before it.
  """
  moe = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "correction_bias")]
  graphdef = nnx.graphdef(model)

  def imbalance(loads) -> list[float]:
    return [float(v) for v in np.asarray(loads.max(-1) / loads.mean(-1))]

  def stats(caches):
    means = loads = None
    for j in range(tok.shape[1]):
      m, l, caches = _routing_stats(graphdef, nnx.state(model), tok[:, j:j + 1], pos[:, j:j + 1], caches)
      means, loads = (m, l) if means is None else (means + m, loads + l)
    return means / tok.shape[1], loads, caches

  before = None
  for _ in range(passes):
    means, loads, caches = stats(caches)
    before = before if before is not None else imbalance(loads)
    for mlp, mean in zip(moe, means):
      old = mlp.correction_bias.get_value()
      mlp.correction_bias.set_value(jax.device_put((-mean).astype(old.dtype), old.sharding))
  _, loads, caches = stats(caches)
  return before, imbalance(loads), caches


def _call_times(step, args: tuple, noise) -> tuple[object, dict]:
  """Host dispatch, chained and synchronised ms per call of ``step(*args, noise[i])``, whose outputs replace
  args[1:] (the last, the caches, is donated). Returns the final caches and the times."""
  fixed, carry = args[0], args[1:]

  def run(i):
    nonlocal carry
    carry = step(fixed, *carry, noise[i % len(noise)])

  run(0)
  jax.block_until_ready(carry)
  sync = []
  for i in range(len(noise)):
    begin = time.perf_counter()
    run(i)
    jax.block_until_ready(carry[0])
    sync.append((time.perf_counter() - begin) * 1e3)
  begin = time.perf_counter()
  for i in range(len(noise)):
    run(i)
  dispatch = (time.perf_counter() - begin) * 1e3 / len(noise)
  jax.block_until_ready(carry)
  chained = (time.perf_counter() - begin) * 1e3 / len(noise)
  return carry[-1], {"dispatch_ms": dispatch, "chained_ms": chained, "sync_ms": statistics.median(sync)}


def dispatch_probe(chained_step, graphdef, state, tok, pos, caches, noise) -> tuple[object, dict]:
  """Where a decode step's host time goes: the real step with the state and caches as pytrees (nnx.State,
  LayerCache) or as flat lists of arrays, and a no-op step over the same arguments (caches donated and
  returned, so it launches ~nothing). Returns the caches (donated through every call) and ms per call."""
  state_leaves, state_def = jax.tree.flatten(state)
  cache_leaves, cache_def = jax.tree.flatten(caches)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def flat_step(state_leaves, tok, pos, cache_leaves, noise):
    tok, pos, new = chained_step.__wrapped__(jax.tree.unflatten(state_def, state_leaves), tok, pos,
                                             jax.tree.unflatten(cache_def, cache_leaves), noise)
    return tok, pos, jax.tree.leaves(new)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def noop(state, tok, pos, caches, noise):
    return tok + noise, pos + 1, caches

  out = {}
  caches, out["step, pytrees"] = _call_times(chained_step, (state, tok, pos, caches), noise)
  cache_leaves = jax.tree.leaves(caches)
  cache_leaves, out["step, flat lists"] = _call_times(flat_step, (state_leaves, tok, pos, cache_leaves), noise)
  cache_leaves, out["no-op, flat lists"] = _call_times(noop, (state_leaves, tok, pos, cache_leaves), noise)
  caches = jax.tree.unflatten(cache_def, cache_leaves)
  caches, out["no-op, pytrees"] = _call_times(noop, (state, tok, pos, caches), noise)
  return caches, out


def stream_tpot(model: M3ForCausalLM, batch: int, prompt_len: int, calls: int, steps_per_call: int = 1,
                seed: int = 0) -> dict:
  """Wall time per token of ``m3jax.generate_stream`` (a host loop of jitted calls of ``steps_per_call`` decode
  steps, call c + 1 dispatched before call c is read): ``batch`` random prompts of ``prompt_len`` tokens,
  ``calls`` x ``steps_per_call`` new tokens each (no EOS). The first two calls (compile, pipeline fill) are
  not timed: the rate runs from the last token of call 2 to the last token."""
  if calls < 4:
    raise ValueError(f"calls must be >= 4 to time a steady state, got {calls}")
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, model.config.text.vocab_size, (batch, prompt_len), dtype=np.int32)
  timings: dict[str, float] = {}
  stamps = []
  for _ in generate_stream(model, prompts, max_new_tokens=calls * steps_per_call, eos_token_ids=[],
                           timings=timings, steps_per_call=steps_per_call):
    stamps.append(time.perf_counter())
  first = 2 * steps_per_call - 1
  call_ms = np.diff(stamps[first::steps_per_call]) * 1e3  # one entry per timed call
  return {"tpot_ms": (stamps[-1] - stamps[first]) * 1e3 / (len(stamps) - 1 - first),
          "call_ms_max": float(call_ms.max()), "tokens": len(stamps), "steps_per_call": steps_per_call,
          "prompt_len": prompt_len, "prefill_first_call_s": timings["prefill_s"]}
