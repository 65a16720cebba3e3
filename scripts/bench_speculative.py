"""MTP speculative decoding on one GPU's shard of full-size M3: the cost of a round against a plain decode step.

A round of ``m3jax.speculative`` (k - 1 MTP draft steps, one target forward over k + 1 tokens, the acceptance,
the MTP catch-up over the k + 1 verified positions) costs t_round(k); a plain decode step costs t_step. Both run
as on-device loops (``lax.fori_loop``, as ``generate`` / ``generate_speculative`` run them), with caches holding
--context tokens per sequence and tokens sampled at temperature 1 (random weights give near-uniform
distributions, so tokens spread over the vocabulary and the experts as real rows do).

Random weights say nothing about how often a trained MTP module's drafts are accepted, so the speedup is given
as a projection: with a per-draft acceptance a (drafts accepted independently), a round yields
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens, and speculation is faster by E(a, k) x t_step / t_round(k).

  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python3 scripts/bench_speculative.py --one-shard 8 \\
      --concurrency 4 --drafts 1,2,3 --out $OUT/spec.json
  --stream-prompt 256 also times generate_speculative_stream (rounds_per_call 1 and 4) against those rounds.
  CPU smoke:  JAX_PLATFORMS=cpu PYTHONPATH=$PWD python3 scripts/bench_speculative.py --smoke
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

from bench_full import model_config, random_caches, random_params, shard_config
from m3jax import sharding
from m3jax.generate import _decode
from m3jax.model import M3ForCausalLM
from m3jax.sampling import SamplingParams, sample
from m3jax.speculative import generate_speculative_stream, speculative_round

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)


def tokens_per_round(a: float, k: int) -> float:
  """Expected tokens of a round with k drafts, each accepted with probability a given its predecessors were."""
  return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def wall_ms(fn, carry, repeats: int = 3):
  """(median ms per call, final carry): fn(carry) -> carry, called once to compile, then ``repeats`` times."""
  begin = time.perf_counter()
  carry = jax.block_until_ready(fn(carry))
  first = time.perf_counter() - begin
  times = []
  for _ in range(repeats):
    begin = time.perf_counter()
    carry = jax.block_until_ready(fn(carry))
    times.append((time.perf_counter() - begin) * 1e3)
  return statistics.median(times), first, carry


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--one-shard", type=int, default=8, metavar="WAYS")
  parser.add_argument("--layers", type=int, default=None, help="default: all 60")
  parser.add_argument("--concurrency", default="4")
  parser.add_argument("--drafts", default="1,2,3", help="draft tokens per round (k) to time")
  parser.add_argument("--context", type=int, default=8192, help="tokens cached per sequence")
  parser.add_argument("--rounds", type=int, default=16, help="rounds / steps per timed call")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the flow)")
  parser.add_argument("--stream-prompt", type=int, default=0, metavar="TOKENS",
                      help="also time m3jax.speculative.generate_speculative_stream (host loop of jitted calls) on "
                           "random prompts of this many tokens, per round, beside the on-device loop")
  parser.add_argument("--stream-rounds-per-call", default="1,4", help="rounds_per_call values for --stream-prompt")
  parser.add_argument("--stream-calls", type=int, default=8, help="calls per stream timing (first 2 not timed)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  cfg = model_config(args.layers, args.smoke)
  if not args.smoke:
    cfg = dataclasses.replace(cfg, text=shard_config(cfg.text, args.one_shard))
  cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_mtp_modules=1))
  t = cfg.text
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  context = 64 if args.smoke else args.context
  plan = sharding.ShardingPlan(sharding.make_mesh("tensor=1"), sharding.RULES)
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=args.kernels, with_mtp=True))
  flat = list(nnx.to_flat_state(nnx.state(abstract)))
  keys = ["/".join(map(str, p)) for p, _ in flat]
  shardings = {k: plan.sharding(sharding.logical_axes_of(v), v.shape) for k, (_, v) in zip(keys, flat)}
  begin = time.perf_counter()
  random_params(flat, keys, shardings)
  model = nnx.merge(nnx.graphdef(abstract), nnx.from_flat_state(flat))
  model.sharding_plan = plan
  graphdef, state = nnx.split(model)
  n_params = sum(int(np.prod(v.shape)) for _, v in flat)
  print(f"{jax.devices()[0].device_kind}: {t.num_layers} layers + 1 MTP module, {n_params / 1e9:.1f}B parameters"
        f" (one GPU of a {args.one_shard}-way split); init {time.perf_counter() - begin:.1f}s", flush=True)
  report: dict = {"device_kind": jax.devices()[0].device_kind, "layers": t.num_layers, "parameters": n_params,
                  "one_shard_of": args.one_shard, "context": context, "rounds_per_call": args.rounds, "rows": []}

  def save():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

  sampling = SamplingParams(temperature=1.0)
  prepare = jax.jit(lambda state: (nnx.merge(graphdef, state).decode_weights(),
                                   nnx.merge(graphdef, state).mtp_decode_weights()))
  prepared, mtp_prepared = prepare(state)
  eos = jnp.asarray([-1], jnp.int32)
  put = functools.partial(sharding.put_replicated, plan=plan)
  drafts = [int(k) for k in args.drafts.split(",") if k]
  for c in (int(x) for x in args.concurrency.split(",")):
    cache_len = -(-(context + 4 * args.rounds * (max(drafts) + 1) + max(drafts) + 1) // 128) * 128

    @functools.partial(jax.jit, donate_argnums=(1,))
    def plain_loop(params, carry):
      """args.rounds sampled decode steps (what ``generate`` runs)."""
      model = nnx.merge(graphdef, params[0])

      def body(_, carry):
        key, logits, pos, caches = carry
        key, sub = jax.random.split(key)
        logits, caches = _decode(model, sample(logits, sub, sampling), pos, caches, params[1])
        return key, logits, pos + 1, caches
      return jax.lax.fori_loop(0, args.rounds, body, carry)

    caches = random_caches(model, plan, c, cache_len)
    logits0 = np.asarray(jax.random.normal(jax.random.key(1), (c, t.vocab_size)), np.float32)
    carry = (put(jax.random.key(0)), put(logits0), put(np.full((c,), context, np.int32)), caches)
    step_ms, step_first, carry = wall_ms(lambda cr: plain_loop((state, prepared), cr), carry)
    del carry, caches
    step = step_ms / args.rounds
    row = {"concurrency": c, "step_ms": step, "step_first_call_s": step_first, "rounds": {}}
    print(f"c={c}: plain decode step {step:.3f} ms (first call {step_first:.1f}s)", flush=True)
    for k in drafts:
      max_new = 4 * args.rounds * (k + 1) + 2  # nobody finishes inside the timed calls

      @functools.partial(jax.jit, donate_argnums=(1,))
      def spec_loop(params, carry, k=k, max_new=max_new):
        model = nnx.merge(graphdef, params[0])
        return jax.lax.fori_loop(0, args.rounds, lambda _, cr: speculative_round(
            model, cr, params[1], params[2], eos, num_draft=k, sampling=sampling, max_new_tokens=max_new), carry)

      carry = dict(
          key=put(jax.random.key(k)), tokens=put(np.zeros((c, max_new), np.int32)),
          produced=put(np.ones((c,), np.int32)), done=put(np.zeros((c,), bool)),
          caches=random_caches(model, plan, c, cache_len),
          mtp_caches=random_caches(model, plan, c, cache_len, mtp=True, seed=c + 1),
          draft_logits=put(logits0), mtp_hidden=put(np.asarray(jax.random.normal(jax.random.key(2), (c, t.hidden_size)),
                                                          np.float32).astype(dtype)),
          p=put(np.full((c,), context, np.int32)),
          x_p=put(np.asarray(jax.random.randint(jax.random.key(3), (c,), 0, t.vocab_size), np.int32)),
          round=put(np.int32(0)), drafts=put(np.full((c, 4 * args.rounds + 1, k), -1, np.int32)),
          accepted=put(np.full((c, 4 * args.rounds + 1), -1, np.int32)))
      round_ms, first_s, carry = wall_ms(lambda cr: spec_loop((state, prepared, mtp_prepared), cr), carry)
      per_round = round_ms / args.rounds
      acc = np.asarray(carry["accepted"])
      rate = float(np.maximum(acc, 0).sum()) / max(int((acc >= 0).sum()) * k, 1)
      del carry
      proj = {str(a): tokens_per_round(a, k) * step / per_round for a in ACCEPTANCE}
      row["rounds"][str(k)] = {"round_ms": per_round, "round_over_step": per_round / step, "first_call_s": first_s,
                               "acceptance_on_random_weights": rate, "projected_speedup": proj}
      print(f"  k={k}: round {per_round:.3f} ms = {per_round / step:.2f} steps (first call {first_s:.1f}s); "
            "projected speedup at acceptance " + ", ".join(f"{a}: {v:.2f}x" for a, v in proj.items()), flush=True)
      report["rows"] = [r for r in report["rows"] if r["concurrency"] != c] + [row]
      save()
      for n in [int(v) for v in args.stream_rounds_per_call.split(",") if v] if args.stream_prompt else []:
        stream = stream_round_ms(model, c, 32 if args.smoke else args.stream_prompt, k, args.stream_calls, n)
        row["rounds"][str(k)][f"stream_{n}"] = stream
        print(f"  k={k} generate_speculative_stream, {n} rounds per call: {stream['round_ms']:.3f} ms per round "
              f"({stream['round_ms'] / per_round:.2f}x the on-device loop's round; slowest call "
              f"{stream['call_ms_max']:.2f} ms)", flush=True)
        save()


def stream_round_ms(model: M3ForCausalLM, batch: int, prompt_len: int, k: int, calls: int, rounds_per_call: int
                    ) -> dict:
  """Wall time per round of ``generate_speculative_stream`` (random prompts, no stop token), from the end of its
  2nd call (compile and pipeline fill excluded) to the end of call ``calls``."""
  if calls < 4:
    raise ValueError(f"--stream-calls must be >= 4, got {calls}")
  prompts = np.random.default_rng(0).integers(0, model.config.text.vocab_size, (batch, prompt_len), dtype=np.int32)
  stats: dict = {}
  stamps, rounds = [], []
  stream = generate_speculative_stream(model, prompts, max_new_tokens=(calls + 2) * rounds_per_call * (k + 1) + 2,
                                       num_draft_tokens=k, temperature=1.0, eos_token_ids=(),
                                       rounds_per_call=rounds_per_call, stats=stats)
  for _ in stream:  # chunk 0 is the prefill's token, chunk i the i-th call's
    stamps.append(time.perf_counter())
    rounds.append(int(stats["rounds"].max()))
    if len(stamps) > calls:
      break
  stream.close()
  call_ms = np.diff(stamps[2:]) * 1e3
  return {"round_ms": (stamps[-1] - stamps[2]) * 1e3 / (rounds[-1] - rounds[2]), "call_ms_max": float(call_ms.max()),
          "rounds_per_call": rounds_per_call, "calls_timed": len(call_ms), "prompt_len": prompt_len}


if __name__ == "__main__":
  main()
