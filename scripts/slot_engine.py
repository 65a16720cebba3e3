"""The slot engine as it was before the paged KV cache (#49), kept unchanged as the same-run baseline of
scripts/bench_serving.py: every slot owns a whole max_length of cache, prompts are prefilled whole at admission, no
prefix reuse. Not part of the package; m3jax.engine.Engine replaced it.

Continuous batching: a fixed number of cache slots decoded together, each refilled with the next waiting request
as soon as its sequence stops (``m3jax batch``).

``generate`` decodes a batch until its longest sequence is done; here a slot whose request has stopped (a stop token,
or its own ``max_new_tokens``) takes the next request at once: the requests admitted together are prefilled in one
call into cache rows of the same length, which are written into their slots' rows of the batch caches, and the
batch's decode steps go on with per-slot positions. Free slots decode too (static shapes, one compile), into rows nobody reads. Greedy requests get
exactly the tokens ``generate`` gives them alone (tested). Each request samples with its own temperature / top-k /
top-p and seed, drawing token t with a key made from the seed and t's position, so a sampled request's tokens do
not depend on the schedule or on the other requests (tested); they are not ``generate``'s, whose key stream is
the batch's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import sharding
from m3jax.generate import (_CACHE_ALIGN, Decoder, _decode, _GraphKey, _prefill, bucket_length,
                            check_prefill_chunk)
from m3jax.model import M3ForCausalLM
from m3jax.sampling import SamplingParams, sample_rows
from m3jax.token_ids import check_count, check_no_placeholders, is_token_id, resolve_stop_ids, token_list


@dataclasses.dataclass(frozen=True)
class Completion:
  """One request's output: request_id (as submitted), tokens int32 [n] (a stop token last if it stopped),
  finish_reason "stop" | "length" | "cancelled" (``Engine.cancel``: the tokens it had by then) | "error" (serving
  it failed: ``error`` says why; the other requests go on), and with ``Engine(logprobs=True)`` each token's
  log-probability float32 [n]."""

  request_id: Any
  tokens: np.ndarray
  finish_reason: str
  logprobs: np.ndarray | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class TopLogprobs:
  """The most likely tokens at each of n positions: ids int32 [n, k] and their log-probabilities float32 [n, k],
  most likely first (k = the engine's ``top_logprobs``)."""

  ids: np.ndarray
  logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Update:
  """A request's tokens from one decode call: new_tokens int32 [n] (n >= 1, or 0 on a cancelled request's last
  update); completion is set on its last one. With ``Engine(logprobs=True)``: logprobs float32 [n], each new
  token's log-probability under the model (its raw logits: before temperature, top-k and top-p), and with
  ``top_logprobs=k`` the k most likely tokens at each of the n positions. A request whose serving failed gets
  a last update with no new tokens and a completion with finish_reason "error"."""

  request_id: Any
  new_tokens: np.ndarray
  completion: Completion | None = None
  logprobs: np.ndarray | None = None
  top_logprobs: TopLogprobs | None = None


@dataclasses.dataclass
class _Slot:
  request_id: Any
  position: int  # where the next token is written
  remaining: int  # tokens still allowed
  tokens: list[int]
  logprobs: list[float]
  sampling: SamplingParams
  seed: int
  finished: bool = False


class EngineBroken(RuntimeError):
  """The engine cannot serve any more (its batch state was lost and could not be rebuilt); ``Engine.broken``
  says why."""


class SlotEngine:
  """Continuous batching over ``slots`` cache rows of ``max_length`` tokens.

  Args:
    model: a loaded M3ForCausalLM (sharded or not; the slots are the batch).
    slots: sequences decoded together.
    max_length: the most tokens one request may hold (prompt + new tokens).
    temperature, top_k, top_p: the sampling of requests that do not set their own (``submit``).
    seed: the seed of requests that do not set their own (request n draws with a seed derived from it and n).
    eos_token_ids: as in ``m3jax.generate``.
    steps_per_call: decode steps per device call (a slot that stops mid-call is refilled after the call).
    prefill_chunk: prefill prompts in chunks of this many tokens, as in ``generate``.
    logprobs: also return each token's log-probability (one log-softmax over the vocabulary per step).
    top_logprobs: also return this many most likely tokens per step (needs logprobs; 0 = none).

  Faults stay local: a request whose prefill fails (e.g. its prompt bucket runs out of device memory) ends with
  finish_reason "error" and the others go on; a failed decode call fails the requests it was decoding. When a
  failure consumed the batch state (donated caches), it is rebuilt; if that fails too, ``broken`` says why and
  ``stream`` raises ``EngineBroken``.
  """

  def __init__(self, model: M3ForCausalLM, *, slots: int, max_length: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               eos_token_ids: Sequence[int] | None = None, steps_per_call: int = 4, prefill_chunk: int | None = None,
               logprobs: bool = False, top_logprobs: int = 0):
    if slots < 1:
      raise ValueError(f"slots must be >= 1, got {slots}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    limit = model.config.text.max_position_embeddings
    if not 2 <= max_length <= limit:
      raise ValueError(f"max_length must be in [2, {limit}] (max_position_embeddings), got {max_length}")
    check_prefill_chunk(prefill_chunk)
    vocab = model.config.text.vocab_size
    if not 0 <= top_logprobs <= vocab or (top_logprobs and not logprobs):
      raise ValueError(f"top_logprobs must be in [0, {vocab}] and needs logprobs=True, got {top_logprobs} "
                       f"(logprobs={logprobs})")
    self.logprobs, self.top_logprobs = logprobs, top_logprobs
    self.model, self.max_length = model, max_length
    self.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    self.eos = np.asarray(list(resolve_stop_ids(eos_token_ids, model.config.text.eos_token_ids, vocab)) or [-1])
    self.steps_per_call, self.prefill_chunk = steps_per_call, prefill_chunk
    self._decoder = Decoder.of(model)
    # Room for a bucketed prompt of up to max_length tokens, and for two calls' steps past a request's end (the
    # call that finishes it and the one dispatched before its tokens are read).
    self._cache_len = -(-(bucket_length(max_length) + 2 * steps_per_call) // _CACHE_ALIGN) * _CACHE_ALIGN
    self._caches = self._decoder.init_caches(slots, self._cache_len)
    self._logits = self._decoder.put(np.zeros((slots, model.config.text.vocab_size), np.float32))
    self._seed = seed
    self._submitted = 0
    self._slots: list[_Slot | None] = [None] * slots
    self._waiting: collections.deque[tuple[Any, list[int], int, SamplingParams, int]] = collections.deque()
    self._cancelled: set[Any] = set()  # request ids to stop at the next call boundary (``cancel``)
    self._lock = threading.Lock()  # submit / cancel may come from other threads than the one running stream
    self.broken: str | None = None  # why the engine cannot serve any more (None while it can)
    self.prefills = 0  # prefill calls so far (each admits every request a free slot can take)
    self.admitted = 0  # requests admitted so far
    self.decode_calls = 0

  def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, request_id: Any = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None) -> None:
    """Queues a request (checked now; run by ``run``). temperature / top_k / top_p default to the engine's; a
    sampled request draws token t with a key made from its seed and t's position, so its tokens depend on its
    prompt, parameters and seed only, not on the requests it shares the slots with."""
    ids = token_list(prompt_ids, f"request {request_id!r}: prompt")
    vocab = self.model.config.text.vocab_size
    if not ids:
      raise ValueError(f"request {request_id!r}: the prompt needs at least one token")
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"request {request_id!r}: prompt ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
    check_no_placeholders(ids, self.model.placeholder_ids, f"request {request_id!r}: the prompt ids")
    max_new_tokens = check_count(max_new_tokens, f"request {request_id!r}: max_new_tokens")
    if len(ids) + max_new_tokens > self.max_length:
      raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"exceeds the engine's max_length ({self.max_length})")
    try:
      sampling = SamplingParams(temperature=self.sampling.temperature if temperature is None else temperature,
                                top_k=self.sampling.top_k if top_k is None else top_k,
                                top_p=self.sampling.top_p if top_p is None else top_p)
    except ValueError as e:
      raise ValueError(f"request {request_id!r}: {e}") from None
    if seed is not None and (not is_token_id(seed) or not 0 <= seed < 2**31):
      raise ValueError(f"request {request_id!r}: seed must be an integer in [0, 2**31), got {seed!r}")
    with self._lock:
      if seed is None:
        seed = (self._seed * 1_000_003 + self._submitted) % 2**31
      self._submitted += 1
      self._waiting.append((request_id, ids, max_new_tokens, sampling, seed))

  def cancel(self, request_id: Any) -> None:
    """Stops a request at the next call boundary: a waiting one is never admitted, a running one's slot is freed
    (its tokens of the call in flight are dropped). ``stream`` then yields its last ``Update``, whose completion
    has finish_reason "cancelled" and the tokens it had. Unknown or finished ids are ignored. Safe to call from
    another thread than the one iterating ``stream`` (as the server's request handlers do)."""
    with self._lock:
      self._cancelled.add(request_id)

  def run(self) -> Iterator[Completion]:
    """Runs every submitted request (and those submitted meanwhile) to completion, yielding each one as it ends."""
    for update in self.stream():
      if update.completion is not None:
        yield update.completion

  def stream(self) -> Iterator[Update]:
    """Like ``run``, yielding every request's new tokens after each decode call (an ``Update`` per active request
    and call; the request's last one carries its ``Completion``).

    As in ``generate_stream``, call c + 1 is dispatched before call c's tokens are read back, so the host's work on
    a call (milliseconds at full size) overlaps the device's work on the one before; a request that stops in call c
    is therefore decoded once more in call c + 1, whose tokens for it are dropped, before its slot is refilled.
    """
    if self.broken is not None:
      raise EngineBroken(self.broken)
    pending = None  # the previous call: (tokens on the device, the slots as they were when it was dispatched)
    while True:
      yield from self._drop_cancelled()
      yield from self._admit()
      dispatched = None
      failed = None
      if any(s is not None for s in self._slots):
        yield from self._fail_unpackable()
      if any(s is not None for s in self._slots):
        try:
          dispatched = (self._dispatch(), list(self._slots))
        except Exception as e:  # pylint: disable=broad-except
          failed = e
      if pending is not None and failed is None:
        try:
          host = jax.tree.map(np.asarray, pending[0])  # a failure of the device call surfaces here
        except Exception as e:  # pylint: disable=broad-except
          failed = e
        else:
          yield from self._collect(host, pending[1])
      pending = dispatched
      if failed is not None:
        pending = None  # a call dispatched after a failed one read the failed one's state
        yield from self._decode_failed(failed)
      if pending is None and not self._waiting and all(s is None for s in self._slots):
        return

  def _drop_cancelled(self) -> Iterator[Update]:
    """Removes the requests ``cancel`` named since the last call, from the waiting queue and from their slots."""
    with self._lock:
      cancelled, self._cancelled = self._cancelled, set()
      waiting = [r for r in self._waiting if r[0] in cancelled]
      if waiting:
        self._waiting = collections.deque(r for r in self._waiting if r[0] not in cancelled)
    for request in waiting:
      yield Update(request_id=request[0], new_tokens=np.zeros((0,), np.int32),
                   completion=Completion(request_id=request[0], tokens=np.zeros((0,), np.int32),
                                         finish_reason="cancelled"))
    for i, slot in enumerate(self._slots):
      if slot is not None and slot.request_id in cancelled:
        slot.finished = True  # its tokens in the call in flight are dropped by _collect
        self._slots[i] = None
        yield Update(request_id=slot.request_id, new_tokens=np.zeros((0,), np.int32),
                     completion=self._completion(slot, "cancelled"))

  def _completion(self, slot: _Slot, finish_reason: str, error: str | None = None) -> Completion:
    return Completion(request_id=slot.request_id, tokens=np.asarray(slot.tokens, np.int32),
                      finish_reason=finish_reason,
                      logprobs=np.asarray(slot.logprobs, np.float32) if self.logprobs else None, error=error)

  def _failure(self, request_id: Any, error: BaseException | str, slot: _Slot | None = None) -> Update:
    """The last update of a request whose serving failed (finish_reason "error", the tokens it had)."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    completion = (self._completion(slot, "error", message) if slot is not None else
                  Completion(request_id=request_id, tokens=np.zeros((0,), np.int32), finish_reason="error",
                             logprobs=np.zeros((0,), np.float32) if self.logprobs else None, error=message))
    return Update(request_id=request_id, new_tokens=np.zeros((0,), np.int32), completion=completion)

  def _fail_slot(self, i: int, error: BaseException | str) -> Update:
    slot = self._slots[i]
    slot.finished = True  # its tokens in the call in flight are dropped by _collect
    self._slots[i] = None
    return self._failure(slot.request_id, error, slot)

  def _state_lost(self) -> bool:
    """True when the batch logits / caches were consumed (donated to a call that failed) or hold a failed call's
    result."""
    leaves = jax.tree.leaves((self._logits, self._caches))
    try:
      if any(x.is_deleted() for x in leaves):
        return True
      jax.block_until_ready(leaves)
    except Exception:  # pylint: disable=broad-except
      return True
    return False

  def _recover(self, error: BaseException) -> Iterator[Update]:
    """After a failed call: if the batch state was lost, every running request fails (its cache rows are gone)
    and the state is rebuilt; a failed rebuild marks the engine broken (EngineBroken)."""
    if not self._state_lost():
      return
    for i, slot in enumerate(self._slots):
      if slot is not None:
        yield self._fail_slot(i, f"the engine's batch state was lost by a failed call ({type(error).__name__}: "
                                 f"{error})")
    self._rebuild(error)

  def _rebuild(self, error: BaseException) -> None:
    """Fresh batch logits and caches after ``error`` lost them; EngineBroken (and ``broken`` set) if that fails."""
    try:
      self._caches = self._decoder.init_caches(len(self._slots), self._cache_len)
      self._logits = self._decoder.put(np.zeros((len(self._slots), self.model.config.text.vocab_size), np.float32))
      jax.block_until_ready((self._logits, self._caches))
    except Exception as e:  # pylint: disable=broad-except
      self.broken = (f"the batch state was lost ({type(error).__name__}: {error}) and could not be rebuilt "
                     f"({type(e).__name__}: {e})")
      raise EngineBroken(self.broken) from e

  def reset(self) -> list[Any]:
    """Drops every waiting and running request (they get no more updates; their ids are returned) and rebuilds
    the batch state if a failure lost it: what a caller does when ``stream`` raised. EngineBroken if the state
    cannot be rebuilt."""
    if self.broken is not None:
      raise EngineBroken(self.broken)
    with self._lock:
      dropped = [r[0] for r in self._waiting]
      self._waiting.clear()
      self._cancelled.clear()
    for i, slot in enumerate(self._slots):
      if slot is not None:
        slot.finished = True
        dropped.append(slot.request_id)
        self._slots[i] = None
    if self._state_lost():
      self._rebuild(RuntimeError("reset after a failure"))
    return dropped

  def _decode_failed(self, error: BaseException) -> Iterator[Update]:
    """A decode call failed: the requests it was decoding fail (they shared it); the others wait on."""
    for i, slot in enumerate(self._slots):
      if slot is not None:
        yield self._fail_slot(i, error)
    yield from self._recover(error)

  def _admit(self) -> Iterator[Update]:
    """Fills the free slots with waiting requests: one prefill for all of them. If it fails, each is prefilled
    alone, so that only the requests whose own prefill fails end with an error."""
    with self._lock:
      free = [i for i, s in enumerate(self._slots) if s is None][: len(self._waiting)]
      admitted = [self._waiting.popleft() for _ in free]
    if not free:
      return
    try:
      self._prefill(free, admitted)
      return
    except Exception as e:  # pylint: disable=broad-except
      if len(free) == 1 or self._state_lost():
        for request in admitted:
          yield self._failure(request[0], e)
        yield from self._recover(e)
        return
    for slot, request in zip(free, admitted):
      try:
        self._prefill([slot], [request])
      except Exception as e:  # pylint: disable=broad-except
        yield self._failure(request[0], e)
        yield from self._recover(e)

  def _prefill(self, free: list[int], admitted: list[tuple[Any, list[int], int, SamplingParams, int]]) -> None:
    """One prefill of ``admitted`` into slots ``free`` (rows padded to a power of two, the padding rows' writes
    dropped), whose rows and last-token logits go into their slots; the slots are taken once it is dispatched."""
    rows = 1 << (len(free) - 1).bit_length()
    width = bucket_length(max(len(a[1]) for a in admitted))
    chunk = self.prefill_chunk if self.prefill_chunk is not None and self.prefill_chunk < width else None
    prompts = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)
    targets = np.full((rows,), len(self._slots), np.int32)  # out of range: dropped
    for r, (slot, (_, ids, _, _, _)) in enumerate(zip(free, admitted)):
      prompts[r, : len(ids)], lengths[r], targets[r] = ids, len(ids), slot
    put = self._decoder.put
    self._logits, self._caches = _admit_jit(self._decoder.graph, self._decoder.params, put(prompts), put(lengths),
                                            put(targets), self._logits, self._caches, cache_len=self._cache_len,
                                            chunk=chunk)
    for slot, (request_id, ids, max_new, sampling, seed) in zip(free, admitted):
      self._slots[slot] = _Slot(request_id=request_id, position=len(ids), remaining=max_new, tokens=[], logprobs=[],
                                sampling=sampling, seed=seed)
    self.prefills += 1
    self.admitted += len(free)

  def _fail_unpackable(self) -> Iterator[Update]:
    """Fails, alone, each running request whose parameters do not fit the decode call's int32 / float32 arrays
    (``submit`` refuses them; this keeps one that got through from failing the call for every slot)."""
    for i, slot in enumerate(self._slots):
      if slot is None:
        continue
      try:
        _slot_row(slot, self.steps_per_call)
      except (OverflowError, ValueError, TypeError) as e:
        yield self._fail_slot(i, e)

  def _dispatch(self) -> dict[str, jax.Array]:
    """Dispatches one call of steps_per_call steps over every slot -> its tokens int32 [steps, slots] (on the
    device; with logprobs also "logprobs" [steps, slots] and "top_ids" / "top_logprobs" [steps, slots, k]). Free
    slots write at position 0 of rows nobody reads."""
    live = list(self._slots)
    rows = [(0, 0, 0.0, 0, 1.0) if s is None else _slot_row(s, self.steps_per_call) for s in live]
    positions, seeds, temperature, top_k, top_p = (np.asarray(col, dtype) for col, dtype in zip(
        zip(*rows), (np.int32, np.int32, np.float32, np.int32, np.float32)))
    for s in live:
      if s is not None:
        s.position += self.steps_per_call  # every step writes a token, past a stop too
    d, put = self._decoder, self._decoder.put
    out, self._logits, self._caches = _steps_jit(
        d.graph, d.params, d.decode_weights, self._logits, self._caches, put(positions), put(seeds),
        put(temperature), put(top_k), put(top_p), num_steps=self.steps_per_call,
        top_logprobs=self.top_logprobs if self.logprobs else -1)
    self.decode_calls += 1
    return out

  def _collect(self, out: dict[str, np.ndarray], slots: list[_Slot | None]) -> Iterator[Update]:
    """Hands a call's tokens (read back to the host) to the request that held each slot at dispatch, if still
    running."""
    tokens = out["tokens"]
    for i, slot in enumerate(slots):
      if slot is None or slot.finished:
        continue
      mine = tokens[: slot.remaining, i]
      stops = np.flatnonzero(np.isin(mine, self.eos))
      if stops.size:
        mine = mine[: stops[0] + 1]
      n = len(mine)
      slot.tokens.extend(mine.tolist())
      slot.remaining -= n
      logprobs = top = None
      if self.logprobs:
        logprobs = out["logprobs"][:n, i]
        slot.logprobs.extend(logprobs.tolist())
        if self.top_logprobs:
          top = TopLogprobs(ids=out["top_ids"][:n, i], logprobs=out["top_logprobs"][:n, i])
      completion = None
      if stops.size or slot.remaining == 0:
        slot.finished = True
        self._slots[i] = None
        completion = self._completion(slot, "stop" if stops.size else "length")
      yield Update(request_id=slot.request_id, new_tokens=mine.astype(np.int32), completion=completion,
                   logprobs=logprobs, top_logprobs=top)


def _slot_row(slot: _Slot, steps: int) -> tuple[np.int32, np.int32, np.float32, np.int32, np.float32]:
  """A running slot's entries of a decode call's per-slot arrays (position, seed, temperature, top_k, top_p);
  OverflowError / ValueError when one does not fit its int32 / float32 (the last position it writes included)."""
  np.int32(slot.position + steps)  # the call writes up to this position
  temperature = np.float32(slot.sampling.temperature)
  if not np.isfinite(temperature):
    raise ValueError(f"temperature {slot.sampling.temperature!r} is not a finite float32")
  return (np.int32(slot.position), np.int32(slot.seed), temperature, np.int32(slot.sampling.top_k or 0),
          np.float32(slot.sampling.top_p or 1.0))


@functools.partial(jax.jit, static_argnames=("graph", "num_steps", "top_logprobs"),
                   donate_argnames=("logits", "caches"))
def _steps_jit(graph: _GraphKey, params, decode_weights, logits, caches, positions, seeds, temperature, top_k, top_p,
               *, num_steps: int, top_logprobs: int):
  """``num_steps`` decode steps over every slot, each slot sampling with its own parameters and a key made from
  its seed and the position of the token drawn -> ({"tokens": int32 [num_steps, slots]; with top_logprobs >= 0
  also "logprobs" float32 [num_steps, slots], and with top_logprobs > 0 "top_ids" / "top_logprobs" [num_steps,
  slots, top_logprobs]}, logits, caches). Log-probabilities are of the raw logits (fp32 log-softmax)."""
  model = graph.merge(params)
  base = jax.vmap(jax.random.key)(seeds)
  slots = logits.shape[0]

  def step(i, carry):
    out, logits, caches = carry
    keys = jax.vmap(jax.random.fold_in)(base, positions + i)
    tok = sample_rows(logits, keys, temperature, top_k, top_p)
    out = {**out, "tokens": out["tokens"].at[i].set(tok)}
    if top_logprobs >= 0:
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      out["logprobs"] = out["logprobs"].at[i].set(jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
      if top_logprobs > 0:
        values, ids = jax.lax.top_k(logp, top_logprobs)
        out["top_ids"] = out["top_ids"].at[i].set(ids.astype(jnp.int32))
        out["top_logprobs"] = out["top_logprobs"].at[i].set(values)
    logits, caches = _decode(model, tok, positions + i, caches, decode_weights)
    return out, logits, caches

  out = {"tokens": jnp.zeros((num_steps, slots), jnp.int32)}
  if top_logprobs >= 0:
    out["logprobs"] = jnp.zeros((num_steps, slots), jnp.float32)
  if top_logprobs > 0:
    out["top_ids"] = jnp.zeros((num_steps, slots, top_logprobs), jnp.int32)
    out["top_logprobs"] = jnp.zeros((num_steps, slots, top_logprobs), jnp.float32)
  carry = (out, logits, caches)
  out, logits, caches = step(0, carry) if num_steps == 1 else jax.lax.fori_loop(0, num_steps, step, carry)
  return jax.tree.map(lambda x: sharding.replicated(x, model.sharding_plan), out), logits, caches


@functools.partial(jax.jit, static_argnames=("graph", "cache_len", "chunk"), donate_argnames=("logits", "caches"))
def _admit_jit(graph: _GraphKey, params, prompts, lengths, slots, logits, caches, *, cache_len: int,
               chunk: int | None):
  """Prefills prompts [R, W] (``lengths`` [R] real tokens) into fresh cache rows and writes row r and its
  last-token logits into batch row ``slots[r]`` (dropped when out of range) -> (logits [slots, V], caches)."""
  row_logits, rows = _prefill(graph.merge(params), prompts, lengths, cache_len, None, chunk)
  logits = logits.at[slots].set(row_logits.astype(logits.dtype), mode="drop")
  caches = jax.tree.map(lambda big, new: big.at[slots].set(new.astype(big.dtype), mode="drop"), caches, rows)
  return logits, caches
