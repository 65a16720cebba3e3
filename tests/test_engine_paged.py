"""The engine's paged KV cache: greedy tokens equal generate() per request with a pool too small for every request
at once (preemption), with prefix-cache hits and with prompts prefilled in chunks between decode calls; every page
is returned at the end. The tiny checkpoint's index block (16 tokens) is the page size."""

import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.engine import Engine
from m3jax.generate import generate
from m3jax.paging import PagePool, page_digests


@pytest.fixture(scope="module")
def model():
  return m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def ids():
  return np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]


def _alone(model, prompt, n):
  out = generate(model, [list(prompt)], max_new_tokens=n, eos_token_ids=())
  return out.tokens[0, : out.lengths[0]].tolist()


def _all_pages_back(engine: Engine) -> None:
  stats = engine.stats()
  assert stats.pages_in_use == 0 and stats.running == 0 and stats.waiting == 0, stats


def test_a_pool_too_small_for_every_request_preempts_the_newest_and_recomputes_it(model, ids):
  # 12 pages of 16 tokens; each request needs 4-6 pages at its end, three at once would need ~15.
  engine = Engine(model, max_seqs=3, max_tokens_in_cache=12 * 16, eos_token_ids=(), steps_per_call=3)
  prompts = [ids[0, :60], ids[1, :45], ids[1, 50:100], ids[0, 70:110]]
  budgets = [30, 25, 20, 12]
  for i, (p, n) in enumerate(zip(prompts, budgets)):
    engine.submit(p.tolist(), max_new_tokens=n, request_id=i)
  sampled = dict(temperature=0.9, top_p=0.95, seed=5)
  engine.submit(ids[1, 10:50].tolist(), max_new_tokens=20, request_id="sampled", **sampled)
  done = {c.request_id: c for c in engine.run()}
  assert engine.preemptions >= 1 and engine.admitted == 5
  for i, (p, n) in enumerate(zip(prompts, budgets)):
    assert done[i].finish_reason == "length" and done[i].tokens.tolist() == _alone(model, p, n), i
  _all_pages_back(engine)
  # A sampled request's tokens do not depend on the schedule: alone (no preemption) it draws the same.
  engine.submit(ids[1, 10:50].tolist(), max_new_tokens=20, request_id="alone", **sampled)
  assert [c.tokens.tolist() for c in engine.run()] == [done["sampled"].tokens.tolist()]


@pytest.mark.quick
def test_a_request_that_cannot_fit_the_pool_alone_is_refused_at_submission(model):
  engine = Engine(model, max_seqs=2, max_tokens_in_cache=4 * 16, max_length=200)
  with pytest.raises(ValueError, match=r"request 'big': prompt \(60 tokens\) \+ max_new_tokens \(10\) needs 5 pages "
                                       r"of 16 tokens; the cache holds 4 \(max_tokens_in_cache\)"):
    engine.submit([1] * 60, max_new_tokens=10, request_id="big")
  engine.submit([1] * 54, max_new_tokens=10, request_id="fits")  # 64 tokens: exactly the pool
  with pytest.raises(ValueError, match="give max_tokens_in_cache"):
    Engine(model, max_seqs=2)
  with pytest.raises(ValueError, match=r"slots \(2\) is the former name of max_seqs \(3\)"):
    Engine(model, slots=2, max_seqs=3, max_length=64)
  with pytest.raises(ValueError, match="page_size must be a multiple of the index block"):
    Engine(model, max_seqs=1, max_tokens_in_cache=64, page_size=24)
  # The former arguments give the former memory: slots x max_length, in whole pages.
  old = Engine(model, slots=3, max_length=100)
  assert old.max_seqs == 3 and old.num_pages == 3 * 7 and old.max_length == 100


def test_a_shared_prefix_is_read_from_the_cache_and_its_tokens_are_generates(model, ids):
  engine = Engine(model, max_seqs=2, max_tokens_in_cache=20 * 16, eos_token_ids=(), steps_per_call=2)
  shared = ids[0, :64].tolist()  # 4 full pages
  first, second = shared + ids[1, :6].tolist(), shared + ids[1, 100:110].tolist()
  engine.submit(first, max_new_tokens=5, request_id="first")
  assert [c.tokens.tolist() for c in engine.run()] == [_alone(model, first, 5)]
  before = engine.stats()
  assert before.prefix_hit_tokens == 0 and before.pages_cached == 4  # 75 tokens: 4 full pages
  engine.submit(second, max_new_tokens=6, request_id="second")
  assert [c.tokens.tolist() for c in engine.run()] == [_alone(model, second, 6)]
  after = engine.stats()
  # Its 4 full prompt pages are looked up (the last prompt token is always prefilled): all 4 hit.
  assert after.prefix_hit_tokens == 64 and after.prefix_query_tokens == 64 + 64
  assert after.prefix_hit_rate == pytest.approx(0.5)
  _all_pages_back(engine)
  # A prompt that is exactly the cached pages still prefills its last page (its last token's logits are needed).
  engine.submit(shared, max_new_tokens=3, request_id="same")
  assert [c.tokens.tolist() for c in engine.run()] == [_alone(model, shared, 3)]
  assert engine.stats().prefix_hit_tokens == 64 + 48


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_requests_decode_calls(model, ids):
  engine = Engine(model, max_seqs=2, max_tokens_in_cache=24 * 16, eos_token_ids=(), steps_per_call=1,
                  prefill_chunk=16)
  short, long = ids[1, :20].tolist(), ids[0, :150].tolist()
  engine.submit(short, max_new_tokens=24, request_id="short")
  short_updates_during_long_prefill = 0
  got: dict[str, list[int]] = {"short": [], "long": []}
  submitted_at = None
  for update in engine.stream():
    got[update.request_id].extend(update.new_tokens.tolist())
    if update.request_id == "short" and len(got["short"]) == 3:
      engine.submit(long, max_new_tokens=4, request_id="long")
      submitted_at = engine.prefills
    elif update.request_id == "short" and submitted_at is not None and not got["long"]:
      short_updates_during_long_prefill += 1
  # 150 tokens in chunks of 16: 10 prefill calls, each followed by a decode call of "short".
  assert engine.prefills - submitted_at >= 10
  assert short_updates_during_long_prefill >= 9
  assert got["short"] == _alone(model, short, 24) and got["long"] == _alone(model, long, 4)
  _all_pages_back(engine)


@pytest.mark.quick
def test_the_page_pool_counts_holders_and_evicts_the_least_recently_released_cached_page():
  pool = PagePool(3, 4)
  a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
  assert pool.allocate() is None and pool.in_use == 3
  keys = page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
  assert keys == page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, 2) and keys[0] != page_digests([1, 2, 3, 5], 4, 1)[0]
  pool.register(a, keys[0])
  pool.register(b, keys[1])
  pool.release([b])
  pool.release([a])  # both cached, unheld: b was released first
  assert pool.available == 2 and pool.cached == 2 and pool.peek(keys) == (2, 2)
  assert pool.acquire_prefix(keys, 8) == [a, b] and pool.available == 0  # held again, by a second holder
  pool.release([a, b])
  pool.release([c])
  assert pool.allocate() == c  # a free page before any cached one
  assert pool.allocate() == a and pool.cached == 1  # then the least recently released cached page
  assert pool.peek(keys) == (0, 0)  # the chain breaks at its first page
  with pytest.raises(RuntimeError, match="released more often than held"):
    pool.release([b])
