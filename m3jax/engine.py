"""Continuous batching over a paged KV cache (``m3jax serve``, ``m3jax batch``).

``generate`` decodes a batch until its longest sequence is done; here a request that has stopped (a stop token, or
its own ``max_new_tokens``) leaves the decode batch at once and the next waiting one takes its row. The KV cache is
a pool of pages (m3jax.cache.PagedLayerCache) that requests take as they grow and give back when they end (m3jax.paging
keeps the books, and full pages for prefix reuse); prompts are prefilled in chunks between decode calls. Prompts
holding images or videos come with their embeddings (``submit(prompt_embeds=...)``), and their pages' prefix keys
with a fingerprint of each placeholder's embedding (m3jax.content_keys). Rows not
decoding run in the decode call too (static shapes, one compile), writing nowhere. Each request samples with its
own temperature / top-k / top-p and seed, drawing token t with a key made from the seed and t's position, so a
sampled request's tokens do not depend on the schedule (preemptions included) or on the other requests (tested);
they are not ``generate``'s, whose key stream is the batch's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import sharding
from m3jax.content_keys import content_keys, media_ids
from m3jax.generate import Decoder, _decode, _GraphKey, bucket_length, check_prefill_chunk, prefill_in_chunks
from m3jax.model import M3ForCausalLM
from m3jax.paging import PagePool, page_digests
from m3jax.sampling import SamplingParams, sample_rows
from m3jax.token_ids import check_count, check_no_placeholders, is_token_id, resolve_stop_ids, token_list

if TYPE_CHECKING:
  from m3jax.engine_conversation import EngineConversation


@dataclasses.dataclass(frozen=True)
class Completion:
  """One request's output: request_id (as submitted), tokens int32 [n] (a stop token last if it stopped),
  finish_reason "stop" | "length" | "cancelled" (``Engine.cancel``: the tokens it had by then) | "error" (serving
  it failed: ``error`` says why; the other requests go on), and with ``Engine(logprobs=True)`` each token's
  log-probability float32 [n]. cached_tokens: the prompt tokens read from the prefix cache instead of prefilled
  (at its first admission: whole pages; OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""

  request_id: Any
  tokens: np.ndarray
  finish_reason: str
  logprobs: np.ndarray | None = None
  error: str | None = None
  cached_tokens: int = 0


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
  a last update with no new tokens and a completion with finish_reason "error". cached_tokens: as the
  completion's (known from the request's first update on, so a reply that ends early, at a stop string, has it)."""

  request_id: Any
  new_tokens: np.ndarray
  completion: Completion | None = None
  logprobs: np.ndarray | None = None
  top_logprobs: TopLogprobs | None = None
  cached_tokens: int = 0


@dataclasses.dataclass
class _Sequence:
  """A request, waiting or running.

  ids: what its prefill computes (the prompt, and after a preemption the tokens it had too); tokens / logprobs:
  what it generated so far; computed: leading ids whose keys the cache holds; pages: its pool pages in order;
  keys: the chain keys of its leading full pages that are registered for prefix reuse; row: its row of the
  decode batch (None while waiting); position: where its next decode step writes. A multimodal request also has
  embeds [len(prompt), H] (its prompt's embeddings, on the host) and prompt_keys (``content_keys`` of its
  prompt: placeholder positions keyed by their embeddings' fingerprints); a text request's keys are its ids.
  """

  request_id: Any
  prompt: list[int]
  remaining: int  # tokens still allowed
  sampling: SamplingParams
  seed: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  ids: list[int] = dataclasses.field(default_factory=list)
  computed: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  keys: list[bytes] = dataclasses.field(default_factory=list)
  row: int | None = None
  position: int = 0
  order: int = 0  # admission order (the newest running request is preempted first)
  preempted: bool = False  # waiting again after a preemption
  lookup: list[bytes] | None = None  # the chain keys of its ids' full pages (but the last token's), once computed
  finished: bool = False  # set when it leaves its row: the call in flight's tokens for it are dropped
  embeds: np.ndarray | None = None
  prompt_keys: list[int] | None = None
  cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission

  @property
  def content(self) -> list[int]:
    """The content keys of ``ids`` (prompt + the tokens it had), what its pages' chain keys hash."""
    return (self.prompt if self.prompt_keys is None else self.prompt_keys) + self.tokens

  @property
  def decoding(self) -> bool:
    return self.row is not None and self.computed == len(self.ids)

  @property
  def limit(self) -> int:
    """Positions below this may hold its real tokens (prompt + every token it may generate)."""
    return len(self.prompt) + len(self.tokens) + self.remaining


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """The engine's cache and queue (for /metrics): pages of ``page_size`` tokens in the pool (``pages_total``),
  held by running requests (``pages_in_use``), kept for prefix reuse (``pages_cached``, held or evictable);
  requests running / waiting; prompt tokens looked up in the prefix cache and those served from it; preemptions."""

  page_size: int
  pages_total: int
  pages_in_use: int
  pages_cached: int
  running: int
  waiting: int
  prefix_query_tokens: int
  prefix_hit_tokens: int
  preemptions: int

  @property
  def prefix_hit_rate(self) -> float:
    """Share of looked-up prompt tokens served from the prefix cache (0 before any lookup)."""
    return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class EngineBroken(RuntimeError):
  """The engine cannot serve any more (its batch state was lost and could not be rebuilt); ``Engine.broken``
  says why."""


_DEFAULT_PREFILL_BUDGET = 2048


class Engine:
  """Continuous batching over a paged KV cache.

  The cache is one pool of pages per layer (K/V and, on sparse layers, the indexer's keys), ``page_size`` tokens a
  page; each running request holds the pages its tokens need, taken as it grows, and gives them back when it ends.
  Up to ``max_seqs`` requests run at once (the rows of the decode batch). When the pool runs out, the newest
  running request is preempted: its pages go back and it waits again, to be recomputed (prefilled with the tokens
  it had) when pages free up; a request that fits the pool alone is never refused for lack of pages.

  Full pages are kept for prefix reuse (``prefix_caching``): a request whose prompt starts with the tokens of
  cached pages (the chain of their tokens, m3jax.paging; at image / video placeholders, of their embeddings'
  fingerprints) reads them instead of prefilling them; unheld cached pages are evicted least recently released
  first when the pool needs pages. ``conversation()`` runs multi-turn conversations on them.

  Prompts are prefilled in chunks: each engine step prefills at most ``prefill_chunk`` prompt tokens (of one
  request or several) and then runs one decode call of the running requests, so a long prompt does not stall
  the requests decoding beside it.

  Args:
    model: a loaded M3ForCausalLM (sharded or not; the ops read the pool through the page tables, or gather the
      pages into rows under a multi-device plan).
    max_tokens_in_cache: the pool's size in tokens (rounded up to whole pages). Default: ``max_seqs`` x
      ``max_length`` (the memory of the former slot engine).
    max_seqs: requests decoded together (the decode batch).
    max_length: the most tokens one request may hold (prompt + new tokens); default
      min(max_tokens_in_cache, max_position_embeddings).
    slots: former name of max_seqs.
    page_size: tokens per page; default the indexer's key block (``index_block_size``: 128 for M3).
    prefix_caching: keep full pages for reuse by later requests.
    temperature, top_k, top_p: the sampling of requests that do not set their own (``submit``).
    seed: the seed of requests that do not set their own (request n draws with a seed derived from it and n).
    eos_token_ids: as in ``m3jax.generate``.
    steps_per_call: decode steps per device call (a request that stops mid-call leaves after the call).
    prefill_chunk: prompt tokens prefilled per engine step (a power of two >= 16; default 2048).
    logprobs: also return each token's log-probability (one log-softmax over the vocabulary per step).
    top_logprobs: also return this many most likely tokens per step (needs logprobs; 0 = none).

  Greedy requests get the tokens ``generate`` gives them alone (tested, with preemption, prefix hits and chunked
  prefill), up to floating-point reassociation. Each request samples with its own temperature / top-k / top-p
  and seed, drawing token t with a key made from the seed and t's position, so its tokens do not depend on the
  schedule or on the other requests (tested).

  Faults stay local: a request whose prefill fails (e.g. its prompt bucket runs out of device memory) ends with
  finish_reason "error" and the others go on; a failed decode call fails the requests it was decoding. When a
  failure consumed the batch state (donated pools), it is rebuilt (the prefix cache is emptied); if that fails too,
  ``broken`` says why and ``stream`` raises ``EngineBroken``.
  """

  def __init__(self, model: M3ForCausalLM, *, max_tokens_in_cache: int | None = None, max_seqs: int | None = None,
               max_length: int | None = None, slots: int | None = None, page_size: int | None = None,
               prefix_caching: bool = True, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0, eos_token_ids: Sequence[int] | None = None,
               steps_per_call: int = 4, prefill_chunk: int | None = None, logprobs: bool = False,
               top_logprobs: int = 0):
    if slots is not None and max_seqs is not None and slots != max_seqs:
      raise ValueError(f"slots ({slots}) is the former name of max_seqs ({max_seqs}); give one")
    max_seqs = max_seqs if max_seqs is not None else slots
    if max_seqs is None or max_seqs < 1:
      raise ValueError(f"max_seqs (formerly slots) must be >= 1, got {max_seqs}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    cfg = model.config.text
    page_size = cfg.index_block_size if page_size is None else page_size
    if page_size < 1 or page_size % cfg.index_block_size:
      raise ValueError(f"page_size must be a multiple of the index block ({cfg.index_block_size}), got {page_size}")
    limit = cfg.max_position_embeddings
    if max_tokens_in_cache is None:
      if max_length is None:
        raise ValueError("give max_tokens_in_cache (the pool's size in tokens) or max_length (tokens per request)")
      max_tokens_in_cache = max_seqs * -(-max_length // page_size) * page_size
    if max_tokens_in_cache < page_size:
      raise ValueError(f"max_tokens_in_cache must be >= one page ({page_size} tokens), got {max_tokens_in_cache}")
    if max_length is None:
      max_length = min(limit, -(-max_tokens_in_cache // page_size) * page_size)
    if not 2 <= max_length <= limit:
      raise ValueError(f"max_length must be in [2, {limit}] (max_position_embeddings), got {max_length}")
    check_prefill_chunk(prefill_chunk)
    vocab = cfg.vocab_size
    if not 0 <= top_logprobs <= vocab or (top_logprobs and not logprobs):
      raise ValueError(f"top_logprobs must be in [0, {vocab}] and needs logprobs=True, got {top_logprobs} "
                       f"(logprobs={logprobs})")
    self.logprobs, self.top_logprobs = logprobs, top_logprobs
    self.model, self.max_length, self.max_seqs = model, max_length, max_seqs
    self.page_size, self.prefix_caching = page_size, prefix_caching
    self.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    self.eos = np.asarray(list(resolve_stop_ids(eos_token_ids, cfg.eos_token_ids, vocab)) or [-1])
    self.steps_per_call = steps_per_call
    self.prefill_chunk = prefill_chunk or _DEFAULT_PREFILL_BUDGET
    self._decoder = Decoder.of(model)
    self._media_ids = media_ids(model)
    self._embed_dtype = np.dtype(model.dtype)
    self._pages = PagePool(-(-max_tokens_in_cache // page_size), page_size)
    self._table_width = -(-max_length // page_size)
    self._caches = self._decoder.init_paged_caches(self._pages.num_pages, page_size)
    self._logits = self._decoder.put(np.zeros((max_seqs, vocab), np.float32))
    self._seed = seed
    self._submitted = 0
    self._rows: list[_Sequence | None] = [None] * max_seqs
    self._waiting: collections.deque[_Sequence] = collections.deque()
    self._cancelled: set[Any] = set()  # request ids to stop at the next call boundary (``cancel``)
    self._lock = threading.Lock()  # submit / cancel may come from other threads than the one running stream
    self._admissions = 0
    self.broken: str | None = None  # why the engine cannot serve any more (None while it can)
    self.prefills = 0  # prefill calls so far (each prefills a chunk of one request's prompt or several)
    self.admitted = 0  # requests admitted so far (a preempted request's readmissions not counted)
    self.preemptions = 0
    self.decode_calls = 0

  @property
  def _slots(self) -> list[_Sequence | None]:
    """The decode batch's rows (None: free)."""
    return self._rows

  @property
  def num_pages(self) -> int:
    return self._pages.num_pages

  def stats(self) -> EngineStats:
    """The cache's pages and the prefix cache's hits so far (cheap: host bookkeeping only)."""
    with self._lock:
      waiting = len(self._waiting)
    counters = self._pages.counters
    return EngineStats(page_size=self.page_size, pages_total=self._pages.num_pages, pages_in_use=self._pages.in_use,
                       pages_cached=self._pages.cached, running=sum(s is not None for s in self._rows),
                       waiting=waiting, prefix_query_tokens=counters.query_tokens,
                       prefix_hit_tokens=counters.hit_tokens, preemptions=self.preemptions)

  def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, request_id: Any = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, prompt_embeds: jax.Array | np.ndarray | None = None) -> None:
    """Queues a request (checked now; run by ``run``). temperature / top_k / top_p default to the engine's; a
    sampled request draws token t with a key made from its seed and t's position, so its tokens depend on its
    prompt, parameters and seed only, not on the requests it shares the batch with. A request that could not fit
    the pool alone is refused here.

    A prompt holding images or videos gives their embeddings: ``prompt_embeds`` [1, len(prompt_ids), H]
    (``model.embed_multimodal``, as ``generate`` and ``Conversation.reply`` take them), fed to the prefill at
    their positions. Its pages' prefix-cache keys hold a fingerprint of each placeholder row's embedding
    (m3jax.content_keys), so the same placeholder ids with another image never read a cached page; the same
    image does."""
    ids = token_list(prompt_ids, f"request {request_id!r}: prompt")
    vocab = self.model.config.text.vocab_size
    if not ids:
      raise ValueError(f"request {request_id!r}: the prompt needs at least one token")
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"request {request_id!r}: prompt ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
    embeds, keys = self._multimodal(ids, prompt_embeds, request_id)
    max_new_tokens = check_count(max_new_tokens, f"request {request_id!r}: max_new_tokens")
    if len(ids) + max_new_tokens > self.max_length:
      raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"exceeds the engine's max_length ({self.max_length})")
    pages = -(-(len(ids) + max_new_tokens) // self.page_size)
    if pages > self._pages.num_pages:
      raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"needs {pages} pages of {self.page_size} tokens; the cache holds "
                       f"{self._pages.num_pages} (max_tokens_in_cache)")
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
      self._waiting.append(_Sequence(request_id=request_id, prompt=ids, remaining=max_new_tokens, sampling=sampling,
                                     seed=seed, ids=list(ids), embeds=embeds, prompt_keys=keys))

  def _multimodal(self, ids: list[int], prompt_embeds: jax.Array | np.ndarray | None, request_id: Any
                  ) -> tuple[np.ndarray | None, list[int] | None]:
    """A request's prompt embeddings as the prefill takes them ([len(ids), H] in the model's dtype, on the host)
    and its prompt's content keys; (None, None) for a text prompt (placeholder ids refused)."""
    what = f"request {request_id!r}: "
    if prompt_embeds is None:
      check_no_placeholders(ids, self.model.placeholder_ids, what + "the prompt ids")
      return None, None
    hidden = self.model.config.text.hidden_size
    shape = tuple(getattr(prompt_embeds, "shape", ()))
    if shape != (1, len(ids), hidden):
      raise ValueError(f"{what}prompt_embeds has shape {shape}; expected [1, {len(ids)}, {hidden}] (the prompt's "
                       "embeddings: model.embed_multimodal)")
    embeds = np.asarray(prompt_embeds)[0].astype(self._embed_dtype)
    keys = content_keys(ids, prompt_embeds, self._media_ids)
    return embeds, (None if keys == ids else keys)

  def conversation(self, *, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                   seed: int = 0) -> EngineConversation:
    """A multi-turn conversation whose turns run on this engine and read the full pages of earlier turns (and of
    other conversations or requests sharing them, e.g. a system prompt) from its prefix cache
    (m3jax.engine_conversation)."""
    from m3jax.engine_conversation import EngineConversation  # pylint: disable=g-import-not-at-top

    return EngineConversation(self, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

  def cancel(self, request_id: Any) -> None:
    """Stops a request at the next call boundary: a waiting one is never admitted, a running one's pages are freed
    (its tokens of the call in flight are dropped). ``stream`` then yields its last ``Update``, whose completion
    has finish_reason "cancelled" and the tokens it had. Unknown or finished ids are ignored. Safe to call from
    another thread than the one iterating ``stream`` (as the server's request handlers do)."""
    with self._lock:
      self._cancelled.add(request_id)

  def serving_stats(self) -> dict[str, int]:
    """Live counts for a server's metrics (m3jax.metrics), from ``stats``: requests "waiting" and "running", the
    sequence rows "cache_slots_used" / "cache_slots_total", the pool's "cache_pages_used" / "cache_pages_total",
    and "prefix_cache_queries" / "prefix_cache_hits" (prompt tokens looked up / found in the prefix cache)."""
    st = self.stats()
    return {"waiting": st.waiting, "running": st.running, "cache_slots_used": st.running,
            "cache_slots_total": len(self._rows), "cache_pages_used": st.pages_in_use,
            "cache_pages_total": st.pages_total, "prefix_cache_queries": st.prefix_query_tokens,
            "prefix_cache_hits": st.prefix_hit_tokens}

  def run(self) -> Iterator[Completion]:
    """Runs every submitted request (and those submitted meanwhile) to completion, yielding each one as it ends."""
    for update in self.stream():
      if update.completion is not None:
        yield update.completion

  def stream(self) -> Iterator[Update]:
    """Like ``run``, yielding every request's new tokens after each decode call (an ``Update`` per decoding
    request and call; the request's last one carries its ``Completion``).

    Each engine step admits waiting requests into free rows, dispatches one prefill call (a chunk of at most
    ``prefill_chunk`` prompt tokens) and one decode call of the requests whose prompts are done. As in
    ``generate_stream``, the decode call of step c + 1 is dispatched before step c's tokens are read back, so the
    host's work overlaps the device's; a request that stops in call c is therefore decoded once more in call
    c + 1 (its writes past its end are dropped: it has no pages there), whose tokens for it are dropped.
    """
    if self.broken is not None:
      raise EngineBroken(self.broken)
    pending = None  # the previous decode call: (tokens on the device, the rows as they were when dispatched)
    while True:
      yield from self._drop_cancelled()
      self._admit()
      yield from self._prefill_step()
      dispatched = None
      failed = None
      if any(s is not None and s.decoding for s in self._rows):
        yield from self._fail_unpackable()
      if any(s is not None and s.decoding for s in self._rows):
        try:
          dispatched = self._dispatch()
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
      if pending is None and not self._waiting and all(s is None for s in self._rows):
        return

  # Pages.

  def _release(self, seq: _Sequence) -> None:
    """``seq`` leaves its row (finished, failed, cancelled or preempted): its pages go back to the pool (full ones
    stay cached for reuse) and its tokens of the call in flight will be dropped."""
    seq.finished = True
    if seq.row is not None and self._rows[seq.row] is seq:
      self._rows[seq.row] = None
    seq.row = None
    self._pages.release(seq.pages)
    seq.pages = []

  def _register_full_pages(self, seq: _Sequence, valid: int) -> None:
    """Registers for prefix reuse the pages of ``seq`` that its first ``valid`` tokens (keys written) fill."""
    if not self.prefix_caching:
      return
    full = min(valid // self.page_size, len(seq.pages))
    if full <= len(seq.keys):
      return
    start, page, cut = len(seq.keys), self.page_size, len(seq.prompt)
    lo, hi = start * page, full * page
    # Content keys lo .. hi of prompt + generated (seq.ids is a prefix of it), without copying the whole history.
    prompt = seq.prompt if seq.prompt_keys is None else seq.prompt_keys
    tokens = prompt[lo:hi] + seq.tokens[max(lo - cut, 0):max(hi - cut, 0)]
    new = page_digests(tokens, page, full - start, seq.keys[-1] if seq.keys else b"")
    for page, key in zip(seq.pages[start:full], new):
      self._pages.register(page, key)
    seq.keys.extend(new)

  def _preempt_newest(self) -> _Sequence | None:
    """Preempts the most recently admitted running request: its pages go back, it waits at the head of the queue
    with the tokens it had (recomputed when readmitted). None if nothing runs."""
    running = [s for s in self._rows if s is not None]
    if not running:
      return None
    victim = max(running, key=lambda s: s.order)
    self._release(victim)
    again = _Sequence(request_id=victim.request_id, prompt=victim.prompt, remaining=victim.remaining,
                      sampling=victim.sampling, seed=victim.seed, tokens=list(victim.tokens),
                      logprobs=list(victim.logprobs), ids=victim.prompt + victim.tokens, preempted=True,
                      embeds=victim.embeds, prompt_keys=victim.prompt_keys, cached_tokens=victim.cached_tokens)
    with self._lock:
      self._waiting.appendleft(again)
    self.preemptions += 1
    return victim

  def _grow(self, seq: _Sequence, upto: int) -> bool:
    """Gives ``seq`` pages for its positions below min(upto, its limit), preempting the newest requests when the
    pool is out of pages; False if ``seq`` itself was preempted."""
    need = -(-min(upto, seq.limit) // self.page_size)
    while len(seq.pages) < need:
      page = self._pages.allocate()
      if page is None:
        victim = self._preempt_newest()
        if victim is seq or victim is None:
          return False
        continue
      seq.pages.append(page)
    return True

  def _table(self, seqs: Sequence[_Sequence | None]) -> np.ndarray:
    """int32 [len(seqs), table width]: each sequence's pages, -1 past them (and for None)."""
    table = np.full((len(seqs), self._table_width), -1, np.int32)
    for r, seq in enumerate(seqs):
      if seq is not None and seq.pages:
        table[r, : len(seq.pages)] = seq.pages
    return table

  # Admission and prefill.

  def _admit(self) -> None:
    """Moves waiting requests into free rows while the pool has the pages their prompts need (beyond the cached
    prefix they will read); their prefix pages are taken now, the rest as their chunks are prefilled."""
    while True:
      with self._lock:
        if not self._waiting or all(s is not None for s in self._rows):
          return
        seq = self._waiting[0]
        if self.prefix_caching and seq.lookup is None:
          # At least the last prompt token is prefilled: its logits give the first new token.
          seq.lookup = page_digests(seq.content, self.page_size, (len(seq.ids) - 1) // self.page_size)
        keys = seq.lookup or []
        hits, unheld = self._pages.peek(keys)
        need = -(-len(seq.ids) // self.page_size) - hits + unheld
        running = sum(s is not None for s in self._rows)
        # Its prompt's pages and a page of headroom for each running request (one to grow into), or it waits; a
        # request alone is always admitted (preemption makes room).
        if running and need + running > self._pages.available:
          return
        self._waiting.popleft()
      seq.row = self._rows.index(None)
      self._rows[seq.row] = seq
      seq.order = self._admissions
      self._admissions += 1
      if self.prefix_caching:
        seq.pages = self._pages.acquire_prefix(keys[:hits], len(keys) * self.page_size)
        seq.keys = keys[: len(seq.pages)]
      seq.computed = len(seq.pages) * self.page_size
      if not seq.preempted:
        self.admitted += 1
        seq.cached_tokens = seq.computed

  def _prefill_step(self) -> Iterator[Update]:
    """One prefill call: the next chunks of the admitted requests' prompts, oldest first, at most
    ``prefill_chunk`` tokens in all. If it fails, each chunk is retried alone, so that only the requests whose own
    prefill fails end with an error."""
    budget = self.prefill_chunk
    chunks: list[tuple[_Sequence, int]] = []
    for seq in sorted((s for s in self._rows if s is not None and not s.decoding), key=lambda s: s.order):
      if budget == 0:
        break
      if seq.row is None:  # preempted by an earlier request's pages this step
        continue
      n = min(len(seq.ids) - seq.computed, budget)
      if not self._grow(seq, seq.computed + n):
        continue
      chunks.append((seq, n))
      budget -= n
    chunks = [(s, n) for s, n in chunks if s.row is not None]  # a later one's pages may have preempted it
    if not chunks:
      return
    try:
      self._prefill(chunks)
      return
    except Exception as e:  # pylint: disable=broad-except
      if len(chunks) == 1 or self._state_lost():
        for seq, _ in chunks:
          yield self._fail(seq, e)
        yield from self._recover(e)
        return
    for chunk in chunks:
      try:
        self._prefill([chunk])
      except Exception as e:  # pylint: disable=broad-except
        yield self._fail(chunk[0], e)
        yield from self._recover(e)

  def _prefill(self, chunks: list[tuple[_Sequence, int]]) -> None:
    """One prefill call over ``chunks`` ((request, tokens) pairs; rows padded to a power of two, the padding
    rows' writes dropped); the logits of a request whose prompt it completes go to its decode row."""
    rows = 1 << (len(chunks) - 1).bit_length()
    width = bucket_length(max(n for _, n in chunks))
    prompts = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)
    starts = np.zeros((rows,), np.int32)
    targets = np.full((rows,), self.max_seqs, np.int32)  # out of range: logits dropped
    for r, (seq, n) in enumerate(chunks):
      prompts[r, :n] = seq.ids[seq.computed: seq.computed + n]
      lengths[r], starts[r] = n, seq.computed
      if seq.computed + n == len(seq.ids):
        targets[r] = seq.row
    table = self._table([seq for seq, _ in chunks] + [None] * (rows - len(chunks)))
    put = self._decoder.put
    embeds, given = self._chunk_embeds(chunks, rows, width)
    self._logits, self._caches = _admit_jit(self._decoder.graph, self._decoder.params, put(prompts), put(lengths),
                                            put(starts), put(targets), put(table), self._logits, self._caches,
                                            None if embeds is None else put(embeds),
                                            None if given is None else put(given))
    for seq, n in chunks:
      seq.computed += n
      self._register_full_pages(seq, seq.computed)
      if seq.decoding:
        seq.position = len(seq.ids)
    self.prefills += 1

  def _chunk_embeds(self, chunks: list[tuple[_Sequence, int]], rows: int, width: int
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The prompt embeddings of a prefill call's chunks: (embeds [rows, width, H], given bool [rows, width]:
    where they replace the token embeddings), or (None, None) when no chunk covers a multimodal prompt's
    positions (text-only calls keep their program)."""
    if not any(seq.embeds is not None and seq.computed < len(seq.embeds) for seq, _ in chunks):
      return None, None
    embeds = np.zeros((rows, width, self.model.config.text.hidden_size), self._embed_dtype)
    given = np.zeros((rows, width), bool)
    for r, (seq, n) in enumerate(chunks):
      if seq.embeds is not None:
        part = seq.embeds[seq.computed: seq.computed + n]  # positions past the prompt (recomputed tokens): text
        embeds[r, : len(part)] = part
        given[r, : len(part)] = True
    return embeds, given

  # Decode.

  def _fail_unpackable(self) -> Iterator[Update]:
    """Fails, alone, each decoding request whose parameters do not fit the decode call's int32 / float32 arrays
    (``submit`` refuses them; this keeps one that got through from failing the call for every row)."""
    for seq in list(self._rows):
      if seq is None or not seq.decoding:
        continue
      try:
        _slot_row(seq, self.steps_per_call)
      except (OverflowError, ValueError, TypeError) as e:
        yield self._fail(seq, e)

  def _dispatch(self) -> tuple[dict[str, jax.Array], list[_Sequence | None]]:
    """Dispatches one call of steps_per_call steps over every row -> (its tokens int32 [steps, rows] on the device,
    with logprobs also "logprobs" [steps, rows] and "top_ids" / "top_logprobs" [steps, rows, k]; the rows it
    decodes). Rows not decoding write nowhere (no pages) and their results are dropped."""
    for seq in sorted((s for s in self._rows if s is not None and s.decoding), key=lambda s: s.order):
      if seq.row is not None:
        self._grow(seq, seq.position + self.steps_per_call)
    live = [s if s is not None and s.decoding else None for s in self._rows]
    rows = [(0, 0, 0.0, 0, 1.0) if s is None else _slot_row(s, self.steps_per_call) for s in live]
    positions, seeds, temperature, top_k, top_p = (np.asarray(col, dtype) for col, dtype in zip(
        zip(*rows), (np.int32, np.int32, np.float32, np.int32, np.float32)))
    for s in live:
      if s is not None:
        s.position += self.steps_per_call  # every step writes a token, past a stop too
    d, put = self._decoder, self._decoder.put
    out, self._logits, self._caches = _steps_jit(
        d.graph, d.params, d.decode_weights, self._logits, self._caches, put(self._table(live)), put(positions),
        put(seeds), put(temperature), put(top_k), put(top_p), num_steps=self.steps_per_call,
        top_logprobs=self.top_logprobs if self.logprobs else -1)
    self.decode_calls += 1
    return out, live

  def _collect(self, out: dict[str, np.ndarray], rows: list[_Sequence | None]) -> Iterator[Update]:
    """Hands a call's tokens (read back to the host) to the request that held each row at dispatch, if still
    running."""
    tokens = out["tokens"]
    for i, seq in enumerate(rows):
      if seq is None or seq.finished:
        continue
      mine = tokens[: seq.remaining, i]
      stops = np.flatnonzero(np.isin(mine, self.eos))
      if stops.size:
        mine = mine[: stops[0] + 1]
      n = len(mine)
      seq.tokens.extend(mine.tolist())
      seq.remaining -= n
      logprobs = top = None
      if self.logprobs:
        logprobs = out["logprobs"][:n, i]
        seq.logprobs.extend(logprobs.tolist())
        if self.top_logprobs:
          top = TopLogprobs(ids=out["top_ids"][:n, i], logprobs=out["top_logprobs"][:n, i])
      completion = None
      # Every token it drew has its keys written (a step writes the token it samples).
      self._register_full_pages(seq, len(seq.prompt) + len(seq.tokens))
      if stops.size or seq.remaining == 0:
        self._release(seq)
        completion = self._completion(seq, "stop" if stops.size else "length")
      yield Update(request_id=seq.request_id, new_tokens=mine.astype(np.int32), completion=completion,
                   logprobs=logprobs, top_logprobs=top, cached_tokens=seq.cached_tokens)

  # Cancels and failures.

  def _drop_cancelled(self) -> Iterator[Update]:
    """Removes the requests ``cancel`` named since the last call, from the waiting queue and from their rows."""
    with self._lock:
      cancelled, self._cancelled = self._cancelled, set()
      waiting = [r for r in self._waiting if r.request_id in cancelled]
      if waiting:
        self._waiting = collections.deque(r for r in self._waiting if r.request_id not in cancelled)
    for seq in waiting:
      yield Update(request_id=seq.request_id, new_tokens=np.zeros((0,), np.int32),
                   completion=self._completion(seq, "cancelled"))
    for seq in list(self._rows):
      if seq is not None and seq.request_id in cancelled:
        self._release(seq)
        yield Update(request_id=seq.request_id, new_tokens=np.zeros((0,), np.int32),
                     completion=self._completion(seq, "cancelled"))

  def _completion(self, seq: _Sequence, finish_reason: str, error: str | None = None) -> Completion:
    return Completion(request_id=seq.request_id, tokens=np.asarray(seq.tokens, np.int32),
                      finish_reason=finish_reason,
                      logprobs=np.asarray(seq.logprobs, np.float32) if self.logprobs else None, error=error,
                      cached_tokens=seq.cached_tokens)

  def _fail(self, seq: _Sequence, error: BaseException | str) -> Update:
    """The last update of a running request whose serving failed (finish_reason "error", the tokens it had)."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    self._release(seq)
    return Update(request_id=seq.request_id, new_tokens=np.zeros((0,), np.int32),
                  completion=self._completion(seq, "error", message))

  def _state_lost(self) -> bool:
    """True when the batch logits / pools were consumed (donated to a call that failed) or hold a failed call's
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
    """After a failed call: if the batch state was lost, every running request fails (its pages are gone) and
    the state is rebuilt; a failed rebuild marks the engine broken (EngineBroken)."""
    if not self._state_lost():
      return
    for seq in list(self._rows):
      if seq is not None:
        yield self._fail(seq, f"the engine's batch state was lost by a failed call ({type(error).__name__}: "
                              f"{error})")
    self._rebuild(error)

  def _rebuild(self, error: BaseException) -> None:
    """Fresh batch logits and pools (an empty prefix cache) after ``error`` lost them; EngineBroken (and
    ``broken`` set) if that fails."""
    self._pages.clear()
    try:
      self._caches = self._decoder.init_paged_caches(self._pages.num_pages, self.page_size)
      self._logits = self._decoder.put(np.zeros((self.max_seqs, self.model.config.text.vocab_size), np.float32))
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
      dropped = [r.request_id for r in self._waiting]
      self._waiting.clear()
      self._cancelled.clear()
    for seq in list(self._rows):
      if seq is not None:
        dropped.append(seq.request_id)
        self._release(seq)
    if self._state_lost():
      self._rebuild(RuntimeError("reset after a failure"))
    return dropped

  def _decode_failed(self, error: BaseException) -> Iterator[Update]:
    """A decode call failed: the requests it was decoding fail (they shared it); the others wait on."""
    for seq in list(self._rows):
      if seq is not None and seq.decoding:
        yield self._fail(seq, error)
    yield from self._recover(error)


def _slot_row(slot: _Sequence, steps: int) -> tuple[np.int32, np.int32, np.float32, np.int32, np.float32]:
  """A running slot's entries of a decode call's per-slot arrays (position, seed, temperature, top_k, top_p);
  OverflowError / ValueError when one does not fit its int32 / float32 (the last position it writes included)."""
  np.int32(slot.position + steps)  # the call writes up to this position
  temperature = np.float32(slot.sampling.temperature)
  if not np.isfinite(temperature):
    raise ValueError(f"temperature {slot.sampling.temperature!r} is not a finite float32")
  return (np.int32(slot.position), np.int32(slot.seed), temperature, np.int32(slot.sampling.top_k or 0),
          np.float32(slot.sampling.top_p or 1.0))


def _paged(caches: tuple, table: jax.Array) -> tuple:
  return tuple(c.with_table(table) for c in caches)


def _pools(caches: tuple) -> tuple:
  """The pools without a call's page tables (what the engine keeps between calls)."""
  return tuple(c.with_table(jnp.full((0, 1), -1, jnp.int32)) for c in caches)


@functools.partial(jax.jit, static_argnames=("graph", "num_steps", "top_logprobs"),
                   donate_argnames=("logits", "caches"))
def _steps_jit(graph: _GraphKey, params, decode_weights, logits, caches, table, positions, seeds, temperature, top_k,
               top_p, *, num_steps: int, top_logprobs: int):
  """``num_steps`` decode steps over every row (its pages: table int32 [rows, pages]), each row sampling with its
  own parameters and a key made from its seed and the position of the token drawn -> ({"tokens": int32
  [num_steps, rows]; with top_logprobs >= 0 also "logprobs" float32 [num_steps, rows], and with top_logprobs > 0
  "top_ids" / "top_logprobs" [num_steps, rows, top_logprobs]}, logits, pools). Log-probabilities are of the raw
  logits (fp32 log-softmax)."""
  model = graph.merge(params)
  caches = _paged(caches, table)
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
  return jax.tree.map(lambda x: sharding.replicated(x, model.sharding_plan), out), logits, _pools(caches)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("logits", "caches"))
def _admit_jit(graph: _GraphKey, params, prompts, lengths, starts, targets, table, logits, caches, embeds=None,
               given=None):
  """Prefills chunks prompts [R, W] (``lengths`` [R] real tokens, the first at position ``starts`` [R]) into the
  pages of table int32 [R, pages], attending to the keys those already hold, and writes row r's last-token logits
  into batch row ``targets[r]`` (dropped when out of range) -> (logits [rows, V], pools). Multimodal chunks give
  embeds [R, W, H], which replace the token embeddings where ``given`` bool [R, W] is set."""
  model = graph.merge(params)

  def run(x, positions, caches, at):
    ids, emb, use = x
    if emb is not None:
      emb = jnp.where(use[..., None], emb.astype(model.dtype), model.embed_tokens(ids))
    out = model.forward(ids, positions=positions, caches=caches, logits_at=at, inputs_embeds=emb)
    return out.logits[:, 0], (), out.caches

  row_logits, _, caches = prefill_in_chunks(run, (prompts, embeds, given), lengths, _paged(caches, table), None,
                                            start=starts)
  logits = logits.at[targets].set(row_logits.astype(logits.dtype), mode="drop")
  return logits, _pools(caches)
