"""Multi-turn generation on a paged engine's prefix cache (``Engine.conversation``).

Each turn gives the whole conversation so far as token ids (and ``prompt_embeds`` for images, as
``Conversation.reply`` takes them) and runs it as one engine request. The full pages of the earlier turns, prompts
and replies alike (the engine registers the pages its generated tokens fill), are read from the engine's prefix
cache instead of prefilled, and so are those of any other conversation or request on the same engine that shares
them: a common system prompt is prefilled once for all of them. Reuse is by whole pages (``page_size`` tokens): the
last, partly filled page of a turn is prefilled again by the next one; a rewritten history is reused up to the
page of its first change. ``Conversation`` keeps one sequence's own caches instead (reuse to the token, nothing
shared).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from m3jax.conversation import TurnStats
from m3jax.token_ids import token_list

if TYPE_CHECKING:
  from m3jax.engine import Engine


class _TurnId:
  """A turn's engine request id (equal only to itself)."""

  def __init__(self, turn: int):
    self.turn = turn

  def __repr__(self) -> str:
    return f"conversation turn {self.turn}"


class EngineConversation:
  """A conversation whose turns run as requests of ``engine``, reusing its prefix cache.

  Args:
    engine: the engine (its max_length, stop tokens and steps_per_call apply). A turn drives the engine's
      ``stream`` itself, so the engine must serve nothing else while a turn runs (``reply`` refuses a busy one).
    temperature, top_k, top_p: the sampling of every turn (default: the engine's).
    seed: turn n samples with a seed made from this and n, so a conversation is reproducible for a seed (its draws
      are the engine's, position-keyed: not ``Conversation``'s stream).

  Greedy replies equal ``generate(model, [prompt_ids], ...)``'s tokens, and ``Conversation``'s, up to
  floating-point reassociation. ``history`` holds the conversation so far (the last prompt and the reply tokens
  read); ``last_turn`` the counts of the last ``reply`` (``reused``: prompt tokens read from the prefix cache).
  """

  def __init__(self, engine: Engine, *, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0):
    if not isinstance(seed, int) or not 0 <= seed < 2**31:
      raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
    self.engine = engine
    self._sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    self._seed = seed
    self._turns = 0
    self._open: _TurnId | None = None  # the request of a turn not yet run to its end
    self.history: list[int] = []
    self.last_turn = TurnStats()

  @property
  def max_length(self) -> int:
    """The most tokens a turn may hold (prompt + reply): the engine's ``max_length``."""
    return self.engine.max_length

  def reset(self) -> None:
    """Forgets the conversation (its pages stay in the engine's prefix cache until evicted)."""
    self._close_open_turn()
    self.history = []

  def reply(self, prompt_ids: Sequence[int], *, max_new_tokens: int, prompt_embeds: jax.Array | None = None
            ) -> Iterator[np.ndarray]:
    """Continues the conversation: ``prompt_ids`` is the whole conversation so far (not only the new turn), and
    ``prompt_embeds`` [1, len(prompt_ids), H] its embeddings when it holds images or videos.

    Yields int32 arrays of new tokens as the engine produces them; the last one ends with a stop token, or the
    reply ends at ``max_new_tokens``. Bad arguments (and a busy engine) raise here, before anything runs; the
    engine runs the turn when the first tokens are asked for. A reply abandoned or interrupted midway leaves the
    tokens read in ``history`` and the engine emptied (``Engine.reset``).
    """
    self._close_open_turn()
    stats = self.engine.stats()
    if stats.running or stats.waiting:
      raise RuntimeError(f"the engine is serving other requests ({stats.running} running, {stats.waiting} waiting): "
                         "a conversation turn drives the engine's stream itself and needs it to itself")
    ids = token_list(prompt_ids, "prompt_ids")
    request = _TurnId(self._turns + 1)
    seed = (self._seed * 1_000_003 + self._turns) % 2**31
    self.engine.submit(ids, max_new_tokens=max_new_tokens, request_id=request, seed=seed,
                       prompt_embeds=prompt_embeds, **self._sampling)
    self._turns += 1
    self._open = request
    self.history = list(ids)
    self.last_turn = TurnStats()
    return self._run(request, len(ids), stats.prefix_hit_tokens)

  def _run(self, request: _TurnId, prompt_length: int, hits_before: int) -> Iterator[np.ndarray]:
    try:
      for update in self.engine.stream():
        if update.request_id is not request:
          continue
        if self.last_turn.prefilled == 0:  # admitted: its prefix hits are counted (it runs alone)
          reused = self.engine.stats().prefix_hit_tokens - hits_before
          self.last_turn.reused, self.last_turn.prefilled = reused, prompt_length - reused
        done = update.completion
        if done is not None and done.finish_reason == "error":
          raise RuntimeError(f"{request!r} failed: {done.error}")
        tokens = update.new_tokens
        self.history.extend(tokens.tolist())
        self.last_turn.generated += len(tokens)
        if done is not None:
          self._open = None
        if tokens.size:
          yield tokens
    finally:
      self._close_open_turn()

  def _close_open_turn(self) -> None:
    """Drops the request of a turn that did not run to its end (abandoned, interrupted, never read) from the
    engine, rebuilding its state if an interruption lost it."""
    if self._open is None:
      return
    self._open = None
    self.engine.reset()
