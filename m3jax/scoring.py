"""Scoring text: per-token log-probabilities, continuation log-likelihoods and perplexity (``m3jax score``).

The log-softmax is taken inside the jitted program, chunk by chunk with ``prefill_chunk`` (each chunk's queries
attending to the caches of the chunks before, as in ``generate``), so a long document never holds more than one
chunk's logits [B, chunk, V] in memory, and only fp32 [B, S] values come back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import sharding
from m3jax.generate import (Decoder, _GraphKey, check_padded_ids, check_prefill_chunk, pad_embeds, pad_prompts,
                            prefill_in_chunks)
from m3jax.model import M3ForCausalLM


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Per-token scores of right-padded sequences.

  logprobs: fp32 [B, S]: log p(ids[b, t] | ids[b, :t]) for 1 <= t < lengths[b]; 0 at t = 0 (nothing to
    condition on) and past each sequence's end.
  greedy: bool [B, S]: ids[b, t] is the most likely next token given ids[b, :t] (ties count); False where
    logprobs is 0 by convention.
  lengths: int32 [B] tokens per sequence.
  top_ids, top_logprobs: with ``token_logprobs(..., top_k=k)``, int32 / fp32 [B, S, k]: the k most likely tokens
    at position t given ids[b, :t] and their log-probabilities (most likely first; the same arithmetic as
    ``logprobs``, so a greedy token's logprob equals the first entry); 0 at t = 0 and past each end. None otherwise.
  """

  logprobs: np.ndarray
  greedy: np.ndarray
  lengths: np.ndarray
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None

  @property
  def scored_tokens(self) -> int:
    """Tokens with a score: every token but each sequence's first."""
    return int(np.maximum(self.lengths - 1, 0).sum())

  def mean_nll(self) -> float:
    """The mean negative log-likelihood (nats) over every scored token of every sequence."""
    if self.scored_tokens == 0:
      raise ValueError("no token to score: every sequence has a single token")
    return -float(self.logprobs.astype(np.float64).sum()) / self.scored_tokens

  def perplexity(self) -> float:
    """exp of ``mean_nll``."""
    return math.exp(self.mean_nll())


@dataclasses.dataclass(frozen=True)
class ContinuationScore:
  """logprob fp32 [B]: log p(continuation | prompt), summed over its tokens; num_tokens int32 [B]; greedy bool [B]:
  every continuation token is the most likely one (greedy decoding would produce the continuation)."""

  logprob: np.ndarray
  num_tokens: np.ndarray
  greedy: np.ndarray


def token_logprobs(model: M3ForCausalLM, sequences: Sequence[Sequence[int]] | np.ndarray, *,
                   prefill_chunk: int | None = None, prompt_embeds: jax.Array | None = None,
                   top_k: int = 0) -> TokenLogprobs:
  """Scores every token of each sequence given the ones before it (one jit-compiled forward).

  Args:
    model: a loaded M3ForCausalLM (sharded or not).
    sequences: token-id lists (lengths may differ; padded to a power-of-two bucket, so a bucket compiles once)
      or an int array [B, S].
    prefill_chunk: run the forward in chunks of this many tokens (a power of two >= 16; ``generate``'s
      ``prefill_chunk``): peak memory is one chunk's activations and logits, not the whole sequence's.
    prompt_embeds: [B, <= S, H] embeddings of the sequences holding images or videos (``model.embed_multimodal``),
      as in ``generate``; the placeholder tokens themselves are scored like any other token.
    top_k: also return the top_k most likely tokens at each position (``TokenLogprobs.top_ids``); 0: none.
  """
  check_prefill_chunk(prefill_chunk)
  vocab = model.config.text.vocab_size
  if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab:
    raise ValueError(f"top_k must be an integer in [0, {vocab}], got {top_k!r}")
  padded, lengths = pad_prompts(sequences)
  check_padded_ids(padded, lengths, model.config.text.vocab_size, "token ids")
  limit = model.config.text.max_position_embeddings
  if int(lengths.max()) > limit:
    raise ValueError(f"a sequence of {int(lengths.max())} tokens exceeds max_position_embeddings ({limit})")
  chunk = prefill_chunk if prefill_chunk is not None and prefill_chunk < padded.shape[1] else None
  decoder = Decoder.of(model)
  embeds = pad_embeds(prompt_embeds, padded)
  out = _logprobs_jit(decoder.graph, decoder.params, decoder.put(padded), decoder.put(lengths),
                      None if embeds is None else decoder.put(embeds), chunk=chunk,
                      **({"top_k": top_k} if top_k else {}))
  logprobs, greedy = np.asarray(out[0]), np.asarray(out[1])
  top_ids, top_logprobs = (np.asarray(out[2]), np.asarray(out[3])) if top_k else (None, None)
  return TokenLogprobs(logprobs=logprobs, greedy=greedy, lengths=lengths, top_ids=top_ids, top_logprobs=top_logprobs)


def score_continuations(model: M3ForCausalLM, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]], *, prefill_chunk: int | None = None
                        ) -> ContinuationScore:
  """log p(continuation | prompt) for each pair (the log-likelihood of evaluation harnesses), batched.

  Every prompt needs at least one token and every continuation at least one.
  """
  if len(prompts) != len(continuations):
    raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
  for i, (p, c) in enumerate(zip(prompts, continuations)):
    if len(p) == 0 or len(c) == 0:
      raise ValueError(f"pair {i}: the prompt ({len(p)} tokens) and continuation ({len(c)}) need a token each")
  scored = token_logprobs(model, [list(p) + list(c) for p, c in zip(prompts, continuations)],
                          prefill_chunk=prefill_chunk)
  starts = np.asarray([len(p) for p in prompts])
  ends = scored.lengths
  cols = np.arange(scored.logprobs.shape[1])[None]
  mine = (cols >= starts[:, None]) & (cols < ends[:, None])
  return ContinuationScore(logprob=np.where(mine, scored.logprobs, 0).sum(1, dtype=np.float64).astype(np.float32),
                           num_tokens=(ends - starts).astype(np.int32),
                           greedy=np.all(scored.greedy | ~mine, axis=1))


@functools.partial(jax.jit, static_argnames=("graph", "chunk", "top_k"))
def _logprobs_jit(graph: _GraphKey, params, ids, lengths, embeds, *, chunk: int | None, top_k: int = 0):
  """ids int32 [B, S] (right-padded; lengths [B]; embeds [B, S, H] or None) -> (logprobs fp32 [B, S], greedy bool
  [B, S]) as in ``TokenLogprobs``, and with top_k > 0 also (top_ids int32 [B, S, top_k], top_logprobs fp32
  [B, S, top_k])."""
  model = graph.merge(params)
  b, s = ids.shape
  targets = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), ids.dtype)], axis=1)  # the token each position predicts

  def run(x, positions, caches, at):
    del at
    tokens, next_tokens, emb = x
    out = model.forward(tokens, positions=positions, caches=caches, inputs_embeds=emb)
    logits = out.logits  # fp32 [B, N, V]
    chosen = jnp.take_along_axis(logits, next_tokens[..., None], axis=-1)[..., 0]
    norm = jax.nn.logsumexp(logits, axis=-1)
    per_token = (chosen - norm, chosen >= logits.max(-1))
    if top_k:
      values, top = jax.lax.top_k(logits, top_k)  # the same subtraction as the chosen token's: equal when greedy
      per_token += (top.astype(jnp.int32), values - norm[..., None])
    return (), per_token, out.caches

  caches = None if chunk is None else model.init_caches(b, s)
  _, per_token, _ = prefill_in_chunks(run, (ids, targets, embeds), lengths, caches, chunk)
  next_logprob, next_greedy = per_token[:2]
  # Position t predicts token t + 1: shift right by one; token 0 and the padding get no score.
  t = jnp.arange(s)[None]
  scored = (t >= 1) & (t < lengths[:, None])
  logprobs = jnp.where(scored, jnp.pad(next_logprob, ((0, 0), (1, 0)))[:, :s], 0.0)
  greedy = scored & jnp.pad(next_greedy, ((0, 0), (1, 0)))[:, :s]
  plan = model.sharding_plan
  out = (logprobs, greedy)
  if top_k:
    shifted = [jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :s] for x in per_token[2:]]
    out += tuple(jnp.where(scored[..., None], x, jnp.zeros((), x.dtype)) for x in shifted)
  return tuple(sharding.replicated(x, plan) for x in out)
