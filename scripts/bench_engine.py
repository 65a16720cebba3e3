"""Continuous batching (m3jax.engine.Engine) against static batches (m3jax.generate), same requests, same run.

The model is bench_generate's real-dims M3 slice (embeddings, LM head and 4 layers: 1 dense, 3 sparse + MoE) with
random bf16 weights. The workload: --requests prompts of random lengths and random completion budgets (random
weights never stop on their own, so a budget plays the part of a stop token). Static batching runs them in
submission order, --slots at a time, each batch decoding until its largest budget (as generate does); the engine
keeps --slots sequences decoding and refills a slot as soon as its request is done; both run the engine's programs
(static = admit only when every slot is free). Reported: wall time, useful tokens per second, and the decode steps
each spends; the engine's tokens are checked against generate's alone for the first requests (greedy: equal up
to bf16 near-ties on the GPU).

  GPU:        PYTHONPATH=$PWD python3 scripts/bench_engine.py --out $OUT/engine.json
  CPU smoke:  PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 scripts/bench_engine.py --smoke --out /tmp/engine.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench_generate import slice_config
from m3jax.engine import Engine
from m3jax.generate import generate
from m3jax.model import M3ForCausalLM
from m3jax.scoring import score_continuations, token_logprobs


def workload(n: int, prompt_range: tuple[int, int], budget_range: tuple[int, int], vocab: int, seed: int
             ) -> list[tuple[list[int], int]]:
  """n (prompt ids, max_new_tokens) pairs with lengths and budgets drawn uniformly from the ranges."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, vocab, int(rng.integers(*prompt_range))).tolist(), int(rng.integers(*budget_range)))
          for _ in range(n)]


class StaticEngine(Engine):
  """Static batching with the engine's own programs: new requests are admitted only when every slot is free, so a
  batch decodes until its largest budget, as ``generate`` over batches of ``slots`` requests would."""

  def _admit(self):
    if all(s is None for s in self._slots):
      super()._admit()


def run(engine_cls, model, requests, slots: int, steps_per_call: int, max_length: int
        ) -> tuple[float, list[list[int]], int]:
  """-> (seconds, each request's tokens, decode steps run)."""
  engine = engine_cls(model, slots=slots, max_length=max_length, eos_token_ids=(), steps_per_call=steps_per_call)
  for i, (p, n) in enumerate(requests):
    engine.submit(p, max_new_tokens=n, request_id=i)
  start = time.perf_counter()
  done = {c.request_id: c.tokens.tolist() for c in engine.run()}
  seconds = time.perf_counter() - start
  return seconds, [done[i] for i in range(len(requests))], engine.decode_calls * steps_per_call


def _gap(model, prompt: list[int], engine_tokens: list[int], alone_tokens: list[int], t: int) -> float:
  """|log p(engine_tokens[t]) - log p(alone_tokens[t])| given prompt + the first t tokens both share."""
  context = list(prompt) + list(alone_tokens[:t])
  scores = score_continuations(model, [context, context], [[engine_tokens[t]], [alone_tokens[t]]])
  return float(abs(scores.logprob[0] - scores.logprob[1]))


def _forward_disagreements(model, prompt: list[int], tokens: list[int]) -> int:
  """How many of a greedy path's tokens are not the top-1 of one full (teacher-forced) forward over prompt +
  tokens: nonzero for generate's own tokens shows bf16 path differences alone flip near-ties in this model."""
  scored = token_logprobs(model, [list(prompt) + list(tokens)])
  return int((~scored.greedy[0, len(prompt): len(prompt) + len(tokens)]).sum())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the whole flow)")
  parser.add_argument("--kernels", default="auto")
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--steps-per-call", type=int, default=4)
  parser.add_argument("--prompt-range", default="1025,2048",
                      help="prompt lengths, uniform in [lo, hi) (default: one prompt bucket, few compiles)")
  parser.add_argument("--budget-range", default="16,256", help="new tokens per request, uniform in [lo, hi)")
  parser.add_argument("--check", type=int, default=1, help="requests whose engine tokens are checked vs generate")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  if args.smoke:
    args.requests, args.slots, args.prompt_range, args.budget_range = min(args.requests, 6), min(args.slots, 2), \
        "8,40", "2,12"
  cfg = slice_config(args.smoke)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  model = nnx.jit(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=args.kernels, rngs=nnx.Rngs(0)))()
  lo_p, hi_p = (int(x) for x in args.prompt_range.split(","))
  lo_b, hi_b = (int(x) for x in args.budget_range.split(","))
  requests = workload(args.requests, (lo_p, hi_p), (lo_b, hi_b), cfg.text.vocab_size, seed=0)
  max_length = hi_p + hi_b
  useful = sum(n for _, n in requests)
  result = {"device": str(jax.devices()[0]), "requests": args.requests, "slots": args.slots,
            "steps_per_call": args.steps_per_call, "prompt_range": [lo_p, hi_p], "budget_range": [lo_b, hi_b],
            "useful_tokens": useful}
  # A first pass of each compiles every program the workload needs (prompt buckets x admitted rows); the second
  # is timed. The engine's tokens are checked against generate's alone for the first requests.
  for name, cls in (("static", StaticEngine), ("engine", Engine)):
    run(cls, model, requests, args.slots, args.steps_per_call, max_length)
    seconds, outputs, steps = run(cls, model, requests, args.slots, args.steps_per_call, max_length)
    result[name] = {"seconds": seconds, "useful_tok_s": useful / seconds, "decode_steps": steps}
    print(name, json.dumps(result[name]), flush=True)
    if name == "engine":
      alone = [generate(model, [p], max_new_tokens=n, eos_token_ids=()).tokens[0].tolist()
               for p, n in requests[: args.check]]
      result["check_equal"] = outputs[: args.check] == alone
      # Where each checked request first differs from generate alone (None: equal), of how many tokens.
      result["check_first_difference"] = [
          next((t for t, (a, b) in enumerate(zip(o, g)) if a != b), None if len(o) == len(g) else min(len(o), len(g)))
          for o, g in zip(outputs, alone)]
      result["check_lengths"] = [len(g) for g in alone]
      # At a difference: |log p(engine's token) - log p(generate's token)| given the prompt and the common prefix,
      # scored by one full forward (a bf16 near-tie is a gap of a few hundredths; a bug is a gap of whole nats).
      result["check_logprob_gaps"] = [None if t is None or t >= min(len(o), len(g)) else _gap(model, p, o, g, t)
                                      for (p, _), o, g, t in zip(requests, outputs, alone,
                                                                 result["check_first_difference"])]
      # The scale to judge a gap by: each path's tokens that are not a full forward's top-1.
      result["check_generate_not_forward_top1"] = [_forward_disagreements(model, p, g)
                                                   for (p, _), g in zip(requests, alone)]
      result["check_engine_not_forward_top1"] = [_forward_disagreements(model, p, o)
                                                 for (p, _), o in zip(requests, outputs[: args.check])]
  result["speedup"] = result["static"]["seconds"] / result["engine"]["seconds"]
  print(json.dumps({k: result[k] for k in ("speedup", "check_equal", "check_first_difference", "check_lengths",
                                         "check_logprob_gaps", "check_generate_not_forward_top1",
                                         "check_engine_not_forward_top1")}))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
