"""Multi-turn generation that keeps one sequence's caches between turns (``m3jax chat``).

Each turn gives the whole conversation so far as token ids (usually a chat template's rendering). The caches
already hold the keys of the previous turn's tokens at their positions, so only the ids after the longest
common prefix with them are prefilled: after a plain reply that is the new user turn, and if the template
rewrites history (dropping a previous reply's reasoning, say, or re-tokenising it differently) the prefill starts
where the ids first differ. That is exact, not an approximation: every cache slot is anchored to its position and
a query reads only positions at or before its own, so slots past the common prefix are rewritten before any
query can see them (m3jax.cache).

Multimodal turns pass ``prompt_embeds`` for the whole conversation (``model.embed_multimodal``); image and video
placeholder positions then match only if their embeddings do too (a fingerprint of each placeholder row), so a
different image behind the same placeholder ids is prefilled again, never served from the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.content_keys import content_keys, media_ids
from m3jax.generate import (_CACHE_ALIGN, Decoder, _GraphKey, bucket_length, check_prefill_chunk, pad_embeds,
                            prefill_in_chunks)
from m3jax.model import M3ForCausalLM
from m3jax.sampling import SamplingParams
from m3jax.token_ids import check_count, check_no_placeholders, resolve_stop_ids, token_list


@dataclasses.dataclass
class TurnStats:
  """What the last ``reply`` did: tokens taken from the cache, tokens prefilled, tokens generated."""

  reused: int = 0
  prefilled: int = 0
  generated: int = 0


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
  """The number of leading ids a and b share."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
  return int(diff[0]) if diff.size else n


class Conversation:
  """One sequence's caches, kept across turns.

  Args:
    model: a loaded M3ForCausalLM (sharded or not).
    max_length: the most tokens the conversation may hold (prompts and replies of every turn); the caches are
      allocated once for it (rounded up to a multiple of 128).
    temperature, top_k, top_p, seed, eos_token_ids: as in ``m3jax.generate`` (one random stream for the whole
      conversation, so a conversation is reproducible for a seed).
    steps_per_call: decode steps per device call, as in ``generate_stream``.
    prefill_chunk: prefill each turn's new ids in chunks of this many tokens, as in ``generate``.

  ``history`` holds the ids whose keys the caches hold, at positions 0 .. len(history) - 1; ``last_turn`` the
  counts of the last ``reply``.
  """

  def __init__(self, model: M3ForCausalLM, *, max_length: int, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0, eos_token_ids: Sequence[int] | None = None,
               steps_per_call: int = 4, prefill_chunk: int | None = None):
    if max_length < 2:
      raise ValueError(f"max_length must be >= 2 (a prompt token and a reply token), got {max_length}")
    limit = model.config.text.max_position_embeddings
    if max_length > limit:
      raise ValueError(f"max_length {max_length} exceeds the model's max_position_embeddings ({limit})")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    check_prefill_chunk(prefill_chunk)
    self.model = model
    self.max_length = max_length
    self.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    self.eos = resolve_stop_ids(eos_token_ids, model.config.text.eos_token_ids, model.config.text.vocab_size)
    self.steps_per_call = steps_per_call
    self.prefill_chunk = prefill_chunk
    self._decoder = Decoder.of(model)
    self._slots = -(-max_length // _CACHE_ALIGN) * _CACHE_ALIGN
    self._caches = self._decoder.init_caches(1, self._slots)
    self._key = self._decoder.put(jax.random.key(seed))
    self.history: list[int] = []
    self._keys: list[int] = []  # per history position: the id, or a fingerprint of a media placeholder's embedding
    self.last_turn = TurnStats()
    self._media_ids = media_ids(model)

  @property
  def caches(self) -> tuple:
    """The per-layer caches (positions 0 .. len(history) - 1 hold the history's keys; do not donate them)."""
    return self._caches

  def reset(self) -> None:
    """Forgets the conversation (the caches are kept and overwritten by the next turn)."""
    self.history, self._keys = [], []

  def reply(self, prompt_ids: Sequence[int], *, max_new_tokens: int, prompt_embeds: jax.Array | None = None
            ) -> Iterator[np.ndarray]:
    """Continues the conversation: ``prompt_ids`` is the whole conversation so far (not only the new turn), and
    ``prompt_embeds`` [1, len(prompt_ids), H] its embeddings when it holds images or videos (as in ``generate``).

    Yields int32 arrays of new tokens as they are produced (up to ``steps_per_call`` at a time); the last one
    ends with a stop token, or the reply ends at ``max_new_tokens``. Afterwards ``history`` is the prompt plus the
    reply. Greedy replies equal ``generate(model, [prompt_ids], ...)``'s tokens, up to floating-point
    reassociation between a prefill of the whole prompt and one of its tail against the caches. Bad arguments
    raise here, before anything runs; the prefill runs when the first tokens are asked for.
    """
    ids = token_list(prompt_ids, "prompt_ids")
    self._check(ids, max_new_tokens)
    if prompt_embeds is None:
      check_no_placeholders(ids, self.model.placeholder_ids, "the prompt ids")
    if prompt_embeds is not None and (prompt_embeds.ndim != 3 or prompt_embeds.shape[:2] != (1, len(ids))):
      raise ValueError(f"prompt_embeds has shape {tuple(prompt_embeds.shape)}; expected [1, {len(ids)}, hidden]")
    return self._turn(ids, max_new_tokens, prompt_embeds)

  def _turn(self, ids: list[int], max_new_tokens: int, prompt_embeds: jax.Array | None) -> Iterator[np.ndarray]:
    if any(x.is_deleted() for x in jax.tree.leaves(self._caches)):
      # An earlier turn was interrupted while a call held the (donated) caches: start them afresh.
      self._caches = self._decoder.init_caches(1, self._slots)
      self.history, self._keys = [], []
    keys = content_keys(ids, prompt_embeds, self._media_ids)
    # Reuse the cached prefix, but prefill at least the last prompt token: its logits give the first new token.
    reused = min(common_prefix_length(self._keys, keys), len(ids) - 1)
    new = ids[reused:]
    self.history, self._keys = ids[:reused], keys[:reused]  # what the caches hold, should the turn be interrupted
    width = bucket_length(len(new))
    if self.prefill_chunk is not None and width > self.prefill_chunk:
      chunk = self.prefill_chunk
    else:
      chunk = None
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(new)] = new
    put = self._decoder.put
    embeds = None if prompt_embeds is None else put(pad_embeds(jnp.asarray(prompt_embeds)[:, reused:], padded))
    logits, self._caches = _extend_jit(self._decoder.graph, self._decoder.params, put(padded),
                                       put(np.asarray([reused], np.int32)), put(np.asarray([len(new)], np.int32)),
                                       embeds, self._caches, chunk=chunk, max_position=self._slots - 1)
    self.history, self._keys = list(ids), keys
    self.last_turn = TurnStats(reused=reused, prefilled=len(new))
    yield from self._decode(logits, max_new_tokens)

  def _decode(self, logits: jax.Array, max_new_tokens: int) -> Iterator[np.ndarray]:
    start = len(self.history)
    room = self._slots - start  # >= max_new_tokens (checked)
    produced = 0
    pending = None
    finished = False
    # As in generate_stream: call c + 1 is dispatched before call c's tokens are read back. Tokens past the
    # stop are written to slots past the history, which the next turn overwrites before reading.
    while pending is not None or (produced < max_new_tokens and not finished):
      dispatched = None
      if produced < max_new_tokens and not finished:
        n = self.steps_per_call if produced + self.steps_per_call <= room else max_new_tokens - produced
        dispatched, logits, self._caches, self._key = self._decoder.sample_steps(
            logits, self._caches, np.asarray([start + produced], np.int32), self._key, self.sampling, n)
        produced += n
      if pending is not None:
        tokens = np.asarray(pending)[:, 0].astype(np.int32)
        tokens = tokens[: max_new_tokens - self.last_turn.generated]
        stops = np.flatnonzero(np.isin(tokens, self.eos))
        if stops.size:
          tokens = tokens[: stops[0] + 1]
          finished = True
        self.history.extend(tokens.tolist())
        self._keys.extend(tokens.tolist())
        self.last_turn.generated += len(tokens)
        if tokens.size:
          yield tokens
        if finished or self.last_turn.generated == max_new_tokens:
          return
      pending = dispatched

  def _check(self, ids: list[int], max_new_tokens: int) -> None:
    if not ids:
      raise ValueError("the conversation needs at least one prompt token")
    check_count(max_new_tokens, "max_new_tokens")
    vocab = self.model.config.text.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"prompt ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
    if len(ids) + max_new_tokens > self.max_length:
      raise ValueError(f"the conversation ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"max_length ({self.max_length} tokens): start a new Conversation with a larger max_length, "
                       "or reset() it")


@functools.partial(jax.jit, static_argnames=("graph", "chunk", "max_position"), donate_argnames=("caches",))
def _extend_jit(graph: _GraphKey, params, ids, start, lengths, embeds, caches, *, chunk: int | None,
                max_position: int):
  """ids int32 [B, N] (right-padded; ``lengths`` [B] real; embeds [B, N, H] or None) written at positions
  start [B] + 0 .. N - 1, attending to the caches' earlier positions -> (logits fp32 [B, V] at each row's last
  real id, caches)."""
  model = graph.merge(params)

  def run(x, positions, caches, at):
    tokens, emb = x
    out = model.forward(tokens, positions=positions, caches=caches, logits_at=at, inputs_embeds=emb)
    return out.logits[:, 0], (), out.caches

  logits, _, caches = prefill_in_chunks(run, (ids, embeds), lengths, caches, chunk, start=start,
                                        max_position=max_position)
  return logits, caches
