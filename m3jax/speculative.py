"""Speculative decoding with M3's MTP modules (M3_SPEC §8): the whole loop in one jit-compiled program
(``generate_speculative``), or streamed by jitted calls of a few rounds each (``generate_speculative_stream``).

Each round, for every sequence whose next token x_p is known but not yet run through the target:
  1. draft: the MTP module proposes d_1 (from x_p and the target's hidden state at p - 1), then d_2 .. d_k, each
     step reading the previous step's output as its hidden state;
  2. verify: one target forward over [x_p, d_1, .., d_k] at positions p .. p + k;
  3. accept the longest prefix of drafts the target agrees with (n of them), plus one token of the target's own
     (the correction after a rejection, or the bonus token after k acceptances): n + 1 new tokens;
  4. catch up: the MTP runs over the k + 1 verified positions with the target's hidden states, rewriting its cache
     there (its draft steps wrote entries from its own hidden states), and its output at the last accepted
     position gives the next round's d_1.

Greedy (temperature 0): a draft is accepted when it equals the target's argmax, so the tokens are exactly
``generate``'s greedy tokens (up to fp ties between a k + 1-token forward and one-token steps). Sampling:
speculative sampling (Leviathan et al. 2023; Chen et al. 2023): d_i, drawn from the draft distribution q, is kept
with probability min(1, p(d_i) / q(d_i)) under the target distribution p (both after temperature / top-k /
top-p), and the first rejected position is redrawn from max(p - q, 0), renormalised; the tokens are then
distributed as the target's own sampling, though not token-equal to ``generate``'s for the same seed.

Positions > p + n written by a round (rejected drafts) are overwritten by the next round before any query can
see them: each forward writes its positions into the caches before attending, and the next round's k + 1
positions start at p + n + 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import sharding
from m3jax.generate import (Decoder, _GraphKey, _put_embeds, _put_fn, _validate, check_prefill_chunk, pad_prompts,
                            prefill_in_chunks, stop_ids, token_buffer_width)
from m3jax.model import M3ForCausalLM
from m3jax.sampling import SamplingParams, filtered_logits, sample
from m3jax.token_ids import check_count


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
  """tokens int32 [B, max_new_tokens] and lengths int32 [B] as in ``GenerateOutput``; for each verification
  round r of the R the loop ran, ``drafts`` int32 [B, R, k] (the tokens the MTP proposed) and ``accepted_drafts``
  int32 [B, R] (how many of them the target kept); both -1 where a sequence had already finished."""

  tokens: np.ndarray
  lengths: np.ndarray
  drafts: np.ndarray
  accepted_drafts: np.ndarray

  @property
  def rounds(self) -> np.ndarray:
    """int32 [B]: the verification rounds each sequence took part in."""
    return np.sum(self.accepted_drafts >= 0, axis=1).astype(np.int32)

  @property
  def accepted(self) -> np.ndarray:
    """int32 [B]: the drafts each sequence accepted over all its rounds."""
    return np.sum(np.maximum(self.accepted_drafts, 0), axis=1).astype(np.int32)

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts / proposed drafts over every sequence and round."""
    proposed = int(self.rounds.sum()) * self.drafts.shape[2]
    return float(self.accepted.sum()) / proposed if proposed else 0.0

  @property
  def tokens_per_round(self) -> float:
    """New tokens per target forward, the prefill's first token left out (1 without speculation; at most k + 1)."""
    rounds = int(self.rounds.sum())
    return float(np.sum(self.lengths - 1)) / rounds if rounds else 0.0


def _accept(target_logits: jax.Array, drafts: jax.Array, draft_logits: jax.Array, key: jax.Array,
            sampling: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """target_logits fp32 [B, k+1, V] at x_p, d_1 .. d_k; drafts int32 [B, k]; draft_logits fp32 [B, k, V] ->
  (n int32 [B]: drafts accepted, emitted int32 [B, k+1]: d_1 .. d_n then the target's token at index n; entries
  past n are the target's argmax, meaningful only up to n)."""
  k = drafts.shape[1]
  idx = jnp.arange(k + 1)
  if sampling.greedy:
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(target[:, :k] == drafts, axis=1), axis=1).astype(jnp.int32)
    return n, target
  p = jax.nn.softmax(filtered_logits(target_logits, sampling), axis=-1)  # [B, k+1, V]
  q = jax.nn.softmax(filtered_logits(draft_logits, sampling), axis=-1)  # [B, k, V]
  p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  key_u, key_r = jax.random.split(key)
  keep = jax.random.uniform(key_u, drafts.shape) * q_d < p_d  # probability min(1, p/q); q(d) > 0: d was drawn
  n = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.where((n < k)[:, None], jnp.take_along_axis(q, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0], 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  # p == q on the whole support leaves nothing (a rejection then has probability 0): fall back to p.
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  fix = jax.random.categorical(key_r, jnp.log(residual), axis=-1).astype(jnp.int32)
  padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
  emitted = jnp.where(idx[None] < n[:, None], padded, fix[:, None])
  return n, emitted


def speculative_round(model: M3ForCausalLM, c: dict[str, jax.Array], prepared, mtp_prepared, eos_ids: jax.Array, *,
                      num_draft: int, sampling: SamplingParams, max_new_tokens: jax.Array | int
                      ) -> dict[str, jax.Array]:
  """One round (draft, verify, accept, catch up) of ``generate_speculative``'s loop on its carry ``c``: key, tokens
  [B, W] (W >= max_new_tokens, which may be traced; slots past it stay pad), produced [B], done [B], caches,
  mtp_caches, draft_logits [B, V] and mtp_hidden [B, H] (the MTP output that gives d_1), p [B] (position of x_p),
  x_p [B], round, drafts [B, R, k], accepted [B, R]. ``prepared`` / ``mtp_prepared``: ``decode_weights()`` / ``mtp_decode_weights()``."""
  k = num_draft
  rows = jnp.arange(c["p"].shape[0])
  key, sub = jax.random.split(c["key"])
  drafts, draft_logits = [sample(c["draft_logits"], sub, sampling)], [c["draft_logits"]]
  hidden, mtp_caches = c["mtp_hidden"], c["mtp_caches"]
  for j in range(1, k):  # draft steps 2 .. k at positions p .. p + k - 2
    key, sub = jax.random.split(key)
    step = model.mtp_forward(drafts[-1][:, None], hidden[:, None], positions=(c["p"] + j - 1)[:, None],
                             caches=mtp_caches, step=j, decode_weights=mtp_prepared)
    mtp_caches, hidden = step.caches, step.hidden[:, 0]
    draft_logits.append(step.logits[:, 0])
    drafts.append(sample(step.logits[:, 0], sub, sampling))
  drafts = jnp.stack(drafts, axis=1)
  verify_pos = c["p"][:, None] + jnp.arange(k + 1, dtype=jnp.int32)
  verify = model.forward(jnp.concatenate([c["x_p"][:, None], drafts], axis=1), positions=verify_pos,
                         caches=c["caches"], decode_weights=prepared)
  key, sub = jax.random.split(key)
  n, emitted = _accept(verify.logits, drafts, jnp.stack(draft_logits, axis=1), sub, sampling)
  # New tokens: emitted[:, :n + 1], cut after a stop token and at max_new_tokens; none for finished rows.
  idx = jnp.arange(k + 1)
  live = idx[None] <= n[:, None]
  stops = live & jnp.isin(emitted, eos_ids)
  count = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, n + 1)
  count = jnp.where(c["done"], 0, jnp.minimum(count, max_new_tokens - c["produced"]))
  slots = jnp.where(idx[None] < count[:, None], c["produced"][:, None] + idx[None], c["tokens"].shape[1] + k + 1)
  tokens = c["tokens"].at[rows[:, None], slots].set(emitted, mode="drop")
  produced = c["produced"] + count
  active = ~c["done"]
  done = c["done"] | jnp.any(stops & (idx[None] < count[:, None]), axis=1) | (produced >= max_new_tokens)
  # Catch-up: the MTP over the verified positions with the target's hidden states; its output at the last
  # accepted position (p + n, reading x_{p+n+1} = emitted[n]) drafts the next round's d_1.
  catch = model.mtp_forward(emitted, verify.hidden, positions=verify_pos, caches=mtp_caches, logits_at=n,
                            decode_weights=mtp_prepared)
  x_next = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]
  r = c["round"]
  return dict(key=key, tokens=tokens, produced=produced, done=done, caches=verify.caches,
              mtp_caches=catch.caches, draft_logits=catch.logits[:, 0], mtp_hidden=catch.hidden[:, 0],
              p=jnp.where(active, c["p"] + n + 1, c["p"]), x_p=jnp.where(active, x_next, c["x_p"]), round=r + 1,
              drafts=c["drafts"].at[:, r].set(jnp.where(active[:, None], drafts, -1)),
              accepted=c["accepted"].at[:, r].set(jnp.where(active, n, -1)))


def _start(model: M3ForCausalLM, prompt: jax.Array, lengths: jax.Array, key: jax.Array, eos_ids: jax.Array,
           pad_id: jax.Array, embeds: jax.Array | None, max_new_tokens: jax.Array, *, width: int, num_draft: int,
           sampling: SamplingParams, cache_len: int, chunk: int | None = None) -> dict[str, jax.Array]:
  """Prefill of the target and of the MTP module -> the round loop's initial carry (``speculative_round``).
  prompt int32 [B, S] right-padded, lengths [B]; embeds: optional multimodal prompt embeddings [B, S, H];
  max_new_tokens: int32 scalar <= width (the token buffer's, ``token_buffer_width``); chunk: both prefills in
  chunks of this many tokens (``generate.prefill_in_chunks``)."""
  b = prompt.shape[0]
  rows = jnp.arange(b)

  def target(x, positions, caches, at):
    ids, emb = x
    out = model.forward(ids, positions=positions, caches=caches, logits_at=at, inputs_embeds=emb)
    return out.logits[:, 0], out.hidden, out.caches

  logits, hidden, caches = prefill_in_chunks(target, (prompt, embeds), lengths, model.init_caches(b, cache_len), chunk)
  key, sub = jax.random.split(key)
  first = sample(logits, sub, sampling)
  # MTP prefill: position t reads x_{t+1} (the prompt shifted left, then the first new token) and h_t. A
  # multimodal prompt's drafter reads its embeddings shifted the same way (image features where x_{t+1} is an
  # image token), as vLLM's proposer gathers them.
  next_ids = jnp.concatenate([prompt[:, 1:], jnp.zeros_like(prompt[:, :1])], axis=1).at[rows, lengths - 1].set(first)
  next_embeds = None
  if embeds is not None:
    next_embeds = jnp.concatenate([embeds[:, 1:], jnp.zeros_like(embeds[:, :1])], axis=1)
    next_embeds = next_embeds.at[rows, lengths - 1].set(model.embed_tokens(first[:, None])[:, 0].astype(embeds.dtype))

  def drafter(x, positions, caches, at):
    ids, h, emb = x
    out = model.mtp_forward(ids, h, positions=positions, caches=caches, logits_at=at, next_embeds=emb)
    return (out.logits[:, 0], out.hidden[:, 0]), (), out.caches

  (draft_logits, mtp_hidden), _, mtp_caches = prefill_in_chunks(
      drafter, (next_ids, hidden, next_embeds), lengths, model.init_mtp_caches(b, cache_len), chunk)
  # Every round gives each live sequence >= 1 token, so at most max_new_tokens - 1 <= width - 1 rounds follow
  # the prefill.
  max_rounds = max(width - 1, 1)
  return dict(key=key, tokens=jnp.full((b, width), pad_id, jnp.int32).at[:, 0].set(first),
              produced=jnp.ones((b,), jnp.int32), done=jnp.isin(first, eos_ids) | (max_new_tokens <= 1),
              caches=caches, mtp_caches=mtp_caches, draft_logits=draft_logits, mtp_hidden=mtp_hidden,
              p=lengths, x_p=first, round=jnp.int32(0), drafts=jnp.full((b, max_rounds, num_draft), -1, jnp.int32),
              accepted=jnp.full((b, max_rounds), -1, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "num_draft", "sampling", "cache_len", "chunk"))
def _speculative_jit(graphdef, state, prompt, lengths, key, eos_ids, pad_id, embeds, max_new_tokens, *, width: int,
                     num_draft: int, sampling: SamplingParams, cache_len: int, chunk: int | None = None):
  model = nnx.merge(graphdef, state)
  init = _start(model, prompt, lengths, key, eos_ids, pad_id, embeds, max_new_tokens, width=width,
                num_draft=num_draft, sampling=sampling, cache_len=cache_len, chunk=chunk)
  prepared, mtp_prepared = model.decode_weights(), model.mtp_decode_weights()

  def cond(carry):
    return ~jnp.all(carry["done"])

  def body(carry):
    return speculative_round(model, carry, prepared, mtp_prepared, eos_ids, num_draft=num_draft, sampling=sampling,
                             max_new_tokens=max_new_tokens)

  final = jax.lax.while_loop(cond, body, init)
  plan = model.sharding_plan
  return tuple(sharding.replicated(final[name], plan)
               for name in ("tokens", "produced", "round", "drafts", "accepted"))


def _prepare(model: M3ForCausalLM, prompt_ids, num_draft_tokens: int, max_new_tokens: int, max_length: int | None,
             pad_token_id: int, temperature: float, top_k: int | None, top_p: float | None,
             prefill_chunk: int | None, prompt_embeds=None) -> tuple[SamplingParams, np.ndarray, np.ndarray, int]:
  """Checks the request before any compute -> (sampling, padded prompts, lengths, cache length)."""
  check_prefill_chunk(prefill_chunk)
  check_count(max_new_tokens, "max_new_tokens")
  check_count(num_draft_tokens, "num_draft_tokens")
  if model.mtp is None:
    raise ValueError("speculative decoding needs the model's MTP modules: load it with with_mtp=True")
  if num_draft_tokens < 1:
    raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  padded, lengths = pad_prompts(prompt_ids, pad_token_id)
  try:
    cache_len = _validate(model, lengths, padded, max_new_tokens + num_draft_tokens, max_length, prompt_embeds)
  except ValueError as e:
    raise ValueError(f"{e} (max_new_tokens counted with the {num_draft_tokens} draft slots of the last "
                     "verification)") from None
  return sampling, padded, lengths, cache_len


def generate_speculative(
    model: M3ForCausalLM,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 1,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    pad_token_id: int = 0,
    max_length: int | None = None,
    prompt_embeds: jax.Array | None = None,
    prefill_chunk: int | None = None,
) -> SpeculativeOutput:
  """``generate`` with MTP speculative decoding: each round drafts ``num_draft_tokens`` tokens with the model's
  MTP module and verifies them in one target forward (one jit-compiled program, like ``generate``).

  The model needs its MTP modules (``m3jax.load(path, with_mtp=True)``). Greedy decoding gives ``generate``'s
  tokens; sampling gives the same distribution (module docstring). The cache holds num_draft_tokens more slots
  than ``generate``'s (the verification window). Arguments are as in ``generate``; with ``prompt_embeds``
  (images / videos) the MTP module also reads them, shifted by one position; ``prefill_chunk`` chunks the
  target's and the MTP's prefill alike.

  Returns:
    SpeculativeOutput (tokens, lengths, and every round's drafts and acceptance counts).
  """
  sampling, padded, lengths, cache_len = _prepare(model, prompt_ids, num_draft_tokens, max_new_tokens, max_length,
                                                  pad_token_id, temperature, top_k, top_p, prefill_chunk,
                                                  prompt_embeds)
  graphdef, state = nnx.split(model)
  put = _put_fn(model)
  tokens, produced, rounds, drafts, accepted = _speculative_jit(
      graphdef, state, put(padded), put(lengths), put(jax.random.key(seed)),
      put(stop_ids(model, eos_token_ids)), put(np.int32(pad_token_id)), _put_embeds(put, prompt_embeds, padded),
      put(np.int32(max_new_tokens)), width=token_buffer_width(max_new_tokens), num_draft=num_draft_tokens,
      sampling=sampling, cache_len=cache_len, chunk=prefill_chunk)
  r = int(rounds)
  return SpeculativeOutput(tokens=np.asarray(tokens)[:, :max_new_tokens], lengths=np.asarray(produced),
                           drafts=np.asarray(drafts)[:, :r],
                           accepted_drafts=np.asarray(accepted)[:, :r])


@functools.partial(jax.jit, static_argnames=("graph", "width", "num_draft", "sampling", "cache_len", "chunk"))
def _start_jit(graph: _GraphKey, params, prompt, lengths, key, eos_ids, pad_id, embeds, max_new_tokens, *, width: int,
               num_draft: int, sampling: SamplingParams, cache_len: int, chunk: int | None = None):
  model = graph.merge(params)
  carry = _start(model, prompt, lengths, key, eos_ids, pad_id, embeds, max_new_tokens, width=width,
                 num_draft=num_draft, sampling=sampling, cache_len=cache_len, chunk=chunk)
  return carry, model.mtp_decode_weights(), _summary(carry, model.sharding_plan)


def _summary(c: dict[str, jax.Array], plan) -> dict[str, jax.Array]:
  """What the host reads after a call, replicated: tokens [B, W] (the first ``produced`` are real), produced [B], done [B], rounds [B]
  and accepted drafts [B] so far."""
  summary = dict(tokens=c["tokens"], produced=c["produced"], done=c["done"],
                 rounds=jnp.sum(c["accepted"] >= 0, axis=1), accepted=jnp.sum(jnp.maximum(c["accepted"], 0), axis=1))
  return {k: sharding.replicated(v, plan) for k, v in summary.items()}


_CACHES = ("caches", "mtp_caches")


@functools.partial(jax.jit, static_argnames=("graph", "num_rounds", "num_draft", "sampling"), donate_argnames=_CACHES)
def _rounds_jit(graph: _GraphKey, params, prepared, mtp_prepared, carry, caches, mtp_caches, eos_ids, max_new_tokens,
                *, num_rounds: int, num_draft: int, sampling: SamplingParams):
  """``num_rounds`` rounds in one call -> (carry without its caches, caches, mtp_caches, ``_summary``)."""
  model = graph.merge(params)

  def body(_, c):
    return speculative_round(model, c, prepared, mtp_prepared, eos_ids, num_draft=num_draft, sampling=sampling,
                             max_new_tokens=max_new_tokens)

  c = dict(carry, caches=caches, mtp_caches=mtp_caches)
  c = body(0, c) if num_rounds == 1 else jax.lax.fori_loop(0, num_rounds, body, c)
  caches, mtp_caches = c.pop("caches"), c.pop("mtp_caches")
  return c, caches, mtp_caches, _summary(c, model.sharding_plan)


def generate_speculative_stream(
    model: M3ForCausalLM,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 1,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    max_length: int | None = None,
    prompt_embeds: jax.Array | None = None,
    rounds_per_call: int = 1,
    stats: dict[str, np.ndarray] | None = None,
    prefill_chunk: int | None = None,
) -> Iterator[list[np.ndarray]]:
  """``generate_speculative``, yielding tokens as the rounds produce them (jitted prefill, then jitted calls of
  ``rounds_per_call`` rounds each).

  Yields, after the prefill and after each call, a list of B int32 arrays: each sequence's new tokens since the
  previous yield (0 .. rounds_per_call x (k + 1) of them; none once it has stopped). Concatenated, they are
  ``generate_speculative``'s tokens for the same arguments (the same random stream). Call c + 1 is dispatched
  before call c's tokens are read, as in ``generate.generate_stream``; the calls after every sequence stops are
  not read. ``stats``, if given, receives after each read 'rounds' and 'accepted' (int32 [B]: verification
  rounds and accepted drafts so far).
  """
  if rounds_per_call < 1:
    raise ValueError(f"rounds_per_call must be >= 1, got {rounds_per_call}")
  sampling, padded, lengths, cache_len = _prepare(model, prompt_ids, num_draft_tokens, max_new_tokens, max_length,
                                                  0, temperature, top_k, top_p, prefill_chunk, prompt_embeds)
  decoder = Decoder.of(model)
  put = decoder.put
  eos_ids = put(stop_ids(model, eos_token_ids))
  limit = put(np.int32(max_new_tokens))
  carry, mtp_prepared, summary = _start_jit(
      decoder.graph, decoder.params, put(padded), put(lengths), put(jax.random.key(seed)), eos_ids, put(np.int32(0)),
      _put_embeds(put, prompt_embeds, padded), limit, width=token_buffer_width(max_new_tokens),
      num_draft=num_draft_tokens, sampling=sampling, cache_len=cache_len, chunk=prefill_chunk)
  caches, mtp_caches = carry.pop("caches"), carry.pop("mtp_caches")
  shown = np.zeros(len(lengths), np.int64)  # tokens yielded per sequence
  done, chunk = _read(summary, shown, stats)
  yield chunk  # the prefill's token
  pending = None
  while not done.all():
    carry, caches, mtp_caches, summary = _rounds_jit(
        decoder.graph, decoder.params, decoder.decode_weights, mtp_prepared, carry, caches, mtp_caches, eos_ids,
        limit, num_rounds=rounds_per_call, num_draft=num_draft_tokens, sampling=sampling)
    if pending is not None:
      done, chunk = _read(pending, shown, stats)
      yield chunk
    pending = summary
  # The call dispatched before the last read started from finished sequences: it has no tokens to read.


def _read(summary: dict[str, jax.Array], shown: np.ndarray, stats: dict | None) -> tuple[np.ndarray, list[np.ndarray]]:
  """A call's summary -> (done [B], each sequence's tokens past ``shown``, which is advanced)."""
  tokens, produced = np.asarray(summary["tokens"]), np.asarray(summary["produced"])
  chunk = [tokens[i, shown[i]: produced[i]].copy() for i in range(len(shown))]
  shown[:] = np.maximum(shown, produced)
  if stats is not None:
    stats["rounds"], stats["accepted"] = np.asarray(summary["rounds"]), np.asarray(summary["accepted"])
  return np.asarray(summary["done"]), chunk
