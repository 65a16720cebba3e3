"""Prefill / decode throughput of a real-dims M3 slice, next to its roofline and the HF baseline.

The slice: embeddings + LM head (vocab 200064) and 4 decoder layers at real M3 dims -- layer 0 dense
(full attention + dense MLP), layers 1-3 sparse (lightning indexer + block-sparse attention + 128-expert
MoE). Random bf16 weights are created directly on the device. For each kernel choice it measures:
  * prefill, batch 1, S = 4096 and 8192 (logits at the last token only): ms and tok/s;
  * decode, batch 1 and 8, 2048-token context: ms per step.
Rooflines: prefill FLOPs / 620 TFLOP/s (measured bf16 matmul rate), decode bytes (weights touched + KV
and index caches read) / 4.3 TB/s (measured copy bandwidth) -- both measured on the H200.

Usage (on the GPU machine):  PYTHONPATH=$PWD python3 scripts/bench_generate.py --kernels reference,auto
Smoke test on a CPU:         PYTHONPATH=$PWD python3 scripts/bench_generate.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.config import M3Config, TextConfig, m3_full
from m3jax.research import Collect
from m3jax.generate import _decode, _prefill
from bench_common import timed_ms
from m3jax.model import M3ForCausalLM

MATMUL_TFLOPS = 620.0  # bf16, measured on the H200
COPY_TBPS = 4.3  # device copy, measured on the H200
HF_BASELINE = {"prefill_8192_ms": 241.0, "decode_b1_ms": 9.5, "decode_b8_ms": 15.1}  # HF on the same GPU


def slice_config(smoke: bool) -> M3Config:
  full = m3_full().text
  layout = dict(num_layers=4, attention_types=("full", "sparse", "sparse", "sparse"),
                mlp_types=("dense", "moe", "moe", "moe"))
  if smoke:
    text = TextConfig(vocab_size=512, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=32,
                      intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, index_num_heads=2, index_head_dim=32,
                      index_block_size=16, index_topk_blocks=2, **layout)
  else:
    text = dataclasses.replace(full, **layout)
  return M3Config(text=text)


def active_params_per_token(t: TextConfig) -> dict[str, float]:
  """Parameters one token multiplies through (excluding the LM head), by layer kind."""
  attn = t.hidden_size * (2 * t.num_heads * t.head_dim + 2 * t.num_kv_heads * t.head_dim)
  indexer = t.hidden_size * (t.index_num_heads + 1) * t.index_head_dim
  dense = 3 * t.hidden_size * t.dense_intermediate_size
  expert = 3 * t.hidden_size * t.intermediate_size
  shared = 3 * t.hidden_size * t.shared_intermediate_size
  router = t.hidden_size * t.num_experts
  return dict(attn=attn, indexer=indexer, dense=dense, expert=expert, shared=shared, router=router)


def prefill_flops(t: TextConfig, s: int) -> float:
  p = active_params_per_token(t)
  linear = 0.0
  attn_flops = 0.0
  for kind, mlp in zip(t.attention_types, t.mlp_types):
    linear += p["attn"] + (p["indexer"] if kind == "sparse" else 0)
    linear += p["dense"] if mlp == "dense" else p["router"] + p["shared"] + t.num_experts_per_tok * p["expert"]
    per_pair = 4 * t.num_heads * t.head_dim  # QK^T and PV
    if kind == "full":
      attn_flops += per_pair * s * (s + 1) / 2
    else:
      window = t.index_topk_blocks * t.index_block_size
      keys = np.minimum(np.arange(1, s + 1), window).sum()
      attn_flops += per_pair * keys + 2 * t.index_num_heads * t.index_head_dim * s * (s + 1) / 2
  return 2 * linear * s + attn_flops + 2 * t.hidden_size * t.vocab_size  # LM head at the last token


def decode_bytes(t: TextConfig, batch: int, context: int, itemsize: int = 2) -> float:
  """Weights touched by one decode step (expected distinct experts under uniform routing) + caches read."""
  p = active_params_per_token(t)
  distinct = t.num_experts * (1 - (1 - t.num_experts_per_tok / t.num_experts) ** batch)
  params = t.hidden_size * t.vocab_size  # LM head
  cache = 0.0
  for kind, mlp in zip(t.attention_types, t.mlp_types):
    params += p["attn"] + (p["indexer"] if kind == "sparse" else 0)
    params += p["dense"] if mlp == "dense" else p["shared"] + distinct * p["expert"]
    params += 0 if mlp == "dense" else p["router"] * 2  # fp32 router
    kv = 2 * t.num_kv_heads * t.head_dim
    if kind == "full":
      cache += batch * context * kv
    else:
      attended = min(context, t.index_topk_blocks * t.index_block_size)
      cache += batch * (attended * kv + context * t.index_head_dim)
  return (params + cache) * itemsize


def with_kernels(model: M3ForCausalLM, kernels: str) -> M3ForCausalLM:
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: M3ForCausalLM(model.config, dtype=model.dtype, kernels=kernels)))
  return nnx.merge(graphdef, nnx.state(model))


def check_logits(model: M3ForCausalLM, kernels: list[str], length: int) -> dict[str, dict]:
  """Logits of every token (batch 1, ``length`` tokens, prefilled in 512-token chunks through the caches) of
  each kernel choice vs reference.

  Per token t: e_t = max|d_t| / max|ref_t|. Reports max / median / p99 of e_t, the fraction of tokens with
  e_t > 1e-2 and whose argmax agrees, and the same split by whether the token's discrete choices agree in
  every layer (its 4 experts and, in sparse layers, its selected key blocks): a discrete flip (a near-tie
  among the router or indexer scores decided differently by two bf16 paths) changes a random-weight token
  by O(0.1), so large e_t confined to flipped tokens is rounding, large e_t on agreeing tokens a bug.
  """
  ids = jax.random.randint(jax.random.key(7), (1, length), 0, model.config.text.vocab_size, jnp.int32)
  collect = Collect(routing=True, block_ids=True)

  chunk = min(512, length)  # chunked through the caches: the reference MoE's ragged_dot needs T*K*E*H*2 bytes

  @nnx.jit
  def step(m, ids, start, caches):
    pos = start + jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    out = m.forward(ids, positions=pos, caches=caches, collect=collect)
    choices = []
    for rec in out.intermediates:
      if "expert_ids" in rec:
        choices.append(jnp.sort(rec["expert_ids"][0], axis=-1))  # [chunk, K]
      if "block_ids" in rec:
        choices.append(jnp.sort(rec["block_ids"][0], axis=-1).reshape(ids.shape[1], -1))  # [chunk, Hi*T]
    return out.logits[0].astype(jnp.float32), choices, out.caches

  def run(m, ids):
    caches = m.init_caches(1, length)
    logits, choices = [], []
    for start in range(0, length, chunk):
      lg, ch, caches = step(m, ids[:, start:start + chunk], jnp.int32(start), caches)
      logits.append(np.asarray(lg))
      choices.append([np.asarray(c) for c in ch])
    return np.concatenate(logits), [np.concatenate(c) for c in zip(*choices)]

  ref, ref_choices = run(with_kernels(model, "reference"), ids)
  errors = {}
  for k in kernels:
    if k == "reference":
      continue
    got, got_choices = run(with_kernels(model, k), ids)
    same = np.ones(length, bool)
    for a, b in zip(ref_choices, got_choices):
      same &= (a == np.asarray(b)).all(-1)
    per_token = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    agree = got.argmax(-1) == ref.argmax(-1)

    def stats(mask):
      e = per_token[mask]
      if not e.size:
        return {"tokens": 0}
      return dict(tokens=int(e.size), max=float(e.max()), median=float(np.median(e)),
                  p99=float(np.quantile(e, 0.99)), frac_above_1e2=float((e > 1e-2).mean()),
                  argmax_agree=float(agree[mask].mean()))

    errors[k] = {"all": stats(np.ones(length, bool)), "same_choices": stats(same), "flipped": stats(~same)}
    for part, v in errors[k].items():
      print(f"  check kernels={k}, {part} tokens: per-token max|d|/max|ref| {v}", flush=True)
  return errors


def kernel_profile(fn, *args) -> dict:
  """GPU time of every launch of one call (CUPTI via jax's Mosaic GPU profiler), grouped by kernel name, and
  every launch in order ("sequence": [(kernel name, us)])."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

  _, per_kernel = profiler.measure(fn, aggregate=False)(*args)
  groups: dict[str, list[float]] = {}
  for name, ms in per_kernel:
    groups.setdefault(name.rstrip("0123456789_.")[:60], []).append(ms * 1e3)
  top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
  return {"launches": len(per_kernel), "gpu_us": round(sum(ms for _, ms in per_kernel) * 1e3, 1),
          "by_name": [(n, len(v), round(sum(v), 1)) for n, v in top[:30]],
          "sequence": [(name, round(ms * 1e3, 2)) for name, ms in per_kernel]}


def bench(model: M3ForCausalLM, prefill_lengths, decode_batches, context: int, repeats: int,
          profile: bool = False) -> dict:
  t = model.config.text
  graphdef, state = nnx.split(model)
  results = {}
  vocab = t.vocab_size

  @jax.jit
  def prefill(state, ids, lengths):
    return _prefill(nnx.merge(graphdef, state), ids, lengths, ids.shape[1] + 128)[0]

  for s in prefill_lengths:
    ids = jax.random.randint(jax.random.key(s), (1, s), 0, vocab, jnp.int32)
    ms = timed_ms(prefill, state, ids, jnp.asarray([s], jnp.int32), repeats=repeats)
    roof = prefill_flops(t, s) / (MATMUL_TFLOPS * 1e12) * 1e3
    results[f"prefill_{s}"] = dict(ms=ms, tok_s=s / ms * 1e3, roofline_ms=roof, roofline_ratio=roof / ms)
    print(f"  prefill S={s}: {ms:.1f} ms ({s / ms * 1e3:.0f} tok/s), roofline {roof:.1f} ms", flush=True)

  cache_len = context + 128

  fill_chunk = 256  # the reference MoE (lax.ragged_dot) materialises [tokens*K, E*H] on GPU: keep chunks small

  @jax.jit
  def fill(state, ids):
    """Prefills the caches with ids [B, context] in chunks of fill_chunk tokens; returns last logits + caches."""
    model = nnx.merge(graphdef, state)
    b = ids.shape[0]
    caches = model.init_caches(b, cache_len)
    for start in range(0, ids.shape[1], fill_chunk):
      chunk = ids[:, start:start + fill_chunk]
      pos = jnp.broadcast_to(jnp.arange(start, start + chunk.shape[1], dtype=jnp.int32), chunk.shape)
      out = model.forward(chunk, positions=pos, caches=caches, logits_at=jnp.full((b,), chunk.shape[1] - 1))
      caches = out.caches
    return out.logits[:, 0], caches

  @jax.jit
  def step(state, tok, pos, caches):
    return _decode(nnx.merge(graphdef, state), tok, pos, caches)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def chained_step(state, tok, pos, caches, noise):
    logits, caches = _decode(nnx.merge(graphdef, state), tok, pos, caches)
    # The next input depends on this step's logits (so steps cannot overlap on the GPU) but is spread over
    # the vocabulary: greedy chains of a random-weight model collapse onto a few repeated tokens, and rows
    # with equal tokens touch fewer experts than real traffic.
    nxt = (jnp.argmax(logits, -1).astype(jnp.int32) + noise) % vocab
    return nxt, pos + 1, caches

  def pipelined_ms(tok, pos, caches, steps: int = 32) -> float:
    """ms per step of `steps` decode steps dispatched back to back (each feeds the next; one sync at the
    end), as a serving loop runs them: host dispatch overlaps the GPU, unlike the one-call-one-sync `timed`."""
    caches = jax.tree.map(jnp.copy, caches)
    noise = jax.random.randint(jax.random.key(11), (steps + 1,) + tok.shape, 0, vocab, jnp.int32)
    tok, pos, caches = chained_step(state, tok, pos, caches, noise[0])  # compile + warm
    jax.block_until_ready(tok)
    start = time.perf_counter()
    for i in range(steps):
      tok, pos, caches = chained_step(state, tok, pos, caches, noise[i + 1])
    jax.block_until_ready(tok)
    return (time.perf_counter() - start) * 1e3 / steps

  for b in decode_batches:
    ids = jax.random.randint(jax.random.key(b), (b, context), 0, vocab, jnp.int32)
    logits, caches = fill(state, ids)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    pos = jnp.full((b,), context, jnp.int32)
    ms = timed_ms(step, state, tok, pos, caches, repeats=repeats * 4)
    roof = decode_bytes(t, b, context) / (COPY_TBPS * 1e12) * 1e3
    piped = pipelined_ms(tok, pos, caches)
    results[f"decode_b{b}"] = dict(ms=ms, roofline_ms=roof, roofline_ratio=roof / ms, pipelined_ms=piped,
                                   pipelined_roofline_ratio=roof / piped)
    print(f"  decode B={b} ctx={context}: {ms:.2f} ms/step (one call, one sync), {piped:.2f} ms/step (32 steps "
          f"back to back), roofline {roof:.2f} ms", flush=True)
    if profile and jax.default_backend() == "gpu":  # CUPTI
      prof = kernel_profile(step, state, tok, pos, caches)
      results[f"decode_b{b}"]["profile"] = prof
      print(f"  decode B={b} profile: {prof['launches']} launches, {prof['gpu_us']} us of GPU time; by name "
            "(launches, us):", flush=True)
      for row in prof["by_name"]:
        print(f"    {row}", flush=True)
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--kernels", default="reference,auto", help="comma-separated kernel choices to compare")
  parser.add_argument("--smoke", action="store_true", help="tiny dims, for a CPU check of the script")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="write results as JSON here")
  parser.add_argument("--prefill-lengths", default=None, help="comma-separated (default 4096,8192; '' = none)")
  parser.add_argument("--decode-batches", default=None, help="comma-separated (default 1,8; '' = none)")
  parser.add_argument("--profile", action="store_true", help="GPU: per-kernel CUPTI breakdown of a decode step")
  parser.add_argument("--check-length", type=int, default=4096,
                      help="tokens of the logits check (> top_k x block = 2048 so block selection is exercised)")
  args = parser.parse_args()
  cfg = slice_config(args.smoke)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  start = time.perf_counter()
  base = nnx.jit(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels="reference", rngs=nnx.Rngs(0)))()
  jax.block_until_ready(nnx.state(base))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
  print(f"device: {jax.devices()[0].device_kind}; slice: {n_params / 1e9:.2f}B params, init "
        f"{time.perf_counter() - start:.1f}s", flush=True)
  lengths, batches, context = ((64, 128), (1, 2), 64) if args.smoke else ((4096, 8192), (1, 8), 2048)
  if args.prefill_lengths is not None:
    lengths = tuple(int(x) for x in args.prefill_lengths.split(",") if x)
  if args.decode_batches is not None:
    batches = tuple(int(x) for x in args.decode_batches.split(",") if x)
  report = {"device": jax.devices()[0].device_kind, "params": n_params, "hf_baseline": HF_BASELINE, "runs": {}}
  choices = args.kernels.split(",")
  if (len(choices) > 1 or choices[0] != "reference") and args.check_length > 0:
    report["logits_check_vs_reference"] = check_logits(base, choices, min(1024, args.check_length) if args.smoke else args.check_length)
  for kernels in choices:
    print(f"kernels={kernels}", flush=True)
    try:
      report["runs"][kernels] = bench(with_kernels(base, kernels), lengths, batches, context, args.repeats,
                                      profile=args.profile and kernels != "reference")
    except Exception as e:  # one failing kernel choice must not hide the others' numbers
      print(f"  kernels={kernels} FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
      report.setdefault("failures", {})[kernels] = f"{type(e).__name__}: {e}"
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  print("\n| kernels | prefill 4K tok/s | prefill 8K ms (tok/s) | 8K roofline ratio | decode b1 ms | decode b8 ms |"
        " b1 roofline ratio | b8 roofline ratio |")
  print("|---|---|---|---|---|---|---|---|")
  for k, r in report["runs"].items():
    print(f"{k}: " + ", ".join(f"{name} {v['ms']:.2f} ms (roofline ratio {v['roofline_ratio']:.2f})"
                                for name, v in r.items()))
    if len(r) < 4:
      continue
    p4, p8 = r[f"prefill_{lengths[0]}"], r[f"prefill_{lengths[1]}"]
    d1, d8 = r[f"decode_b{batches[0]}"], r[f"decode_b{batches[1]}"]
    print(f"| {k} | {p4['tok_s']:.0f} | {p8['ms']:.1f} ({p8['tok_s']:.0f}) | {p8['roofline_ratio']:.2f} | "
          f"{d1['ms']:.2f} | {d8['ms']:.2f} | {d1['roofline_ratio']:.2f} | {d8['roofline_ratio']:.2f} |")
  print(f"| HF transformers (given) | | {HF_BASELINE['prefill_8192_ms']:.0f} | | {HF_BASELINE['decode_b1_ms']} | "
        f"{HF_BASELINE['decode_b8_ms']} | | |")


if __name__ == "__main__":
  main()
