"""Continuous batching: each request gets generate()'s own tokens while slots are refilled as requests stop."""

import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.engine import Engine
from m3jax.generate import generate


@pytest.fixture(scope="module")
def model():
  return m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def ids():
  return np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]


def _alone(model, prompt, n, eos):
  out = generate(model, [prompt], max_new_tokens=n, eos_token_ids=eos)
  return out.tokens[0, : out.lengths[0]].tolist()


@pytest.mark.parametrize("steps_per_call", [1, 3])
@pytest.mark.slow
def test_every_request_gets_its_own_greedy_tokens_as_slots_are_refilled(model, ids, steps_per_call):
  prompts = [ids[0, :150], ids[1, :37], ids[0, 20:101], ids[1, 90:110], ids[0, :100], ids[1, :64]]
  budgets = [10, 3, 7, 5, 12, 8]
  # A stop token that the first request meets early: its slot frees after a few tokens.
  stop = _alone(model, prompts[0].tolist(), 10, ())[2]
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(stop,), steps_per_call=steps_per_call)
  for i, (p, n) in enumerate(zip(prompts, budgets)):
    engine.submit(p.tolist(), max_new_tokens=n, request_id=f"r{i}")
  done = {c.request_id: c for c in engine.run()}
  assert sorted(done) == [f"r{i}" for i in range(6)] and engine.admitted == 6
  assert engine.prefills < 6  # the first two requests share one prefill
  for i, (p, n) in enumerate(zip(prompts, budgets)):
    want = _alone(model, p.tolist(), n, (stop,))
    got = done[f"r{i}"]
    assert got.tokens.dtype == np.int32 and got.tokens.tolist() == want, i
    assert got.finish_reason == ("stop" if want[-1] == stop else "length")
  assert done["r0"].finish_reason == "stop" and len(done["r0"].tokens) == 3
  # The slots overlap the requests: fewer decode calls than running them one after another.
  sequential = sum(-(-len(c.tokens) // steps_per_call) for c in done.values())
  assert engine.decode_calls < sequential


def test_requests_submitted_while_running_are_served(model, ids):
  engine = Engine(model, slots=1, max_length=128, eos_token_ids=(), steps_per_call=2)
  engine.submit(ids[0, :30].tolist(), max_new_tokens=4, request_id="a")
  got = []
  for c in engine.run():
    got.append(c)
    if c.request_id == "a":
      engine.submit(ids[1, :50].tolist(), max_new_tokens=5, request_id="b")
  assert [c.request_id for c in got] == ["a", "b"]
  assert got[1].tokens.tolist() == _alone(model, ids[1, :50].tolist(), 5, ())


@pytest.mark.quick
def test_bad_requests_fail_at_submit(model):
  engine = Engine(model, slots=2, max_length=64)
  with pytest.raises(ValueError, match=r"request 'x': prompt \(60 tokens\) \+ max_new_tokens \(5\) exceeds"):
    engine.submit([1] * 60, max_new_tokens=5, request_id="x")
  with pytest.raises(ValueError, match="at least one token"):
    engine.submit([], max_new_tokens=5)
  with pytest.raises(ValueError, match="outside"):
    engine.submit([256], max_new_tokens=5)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    engine.submit([1], max_new_tokens=0)
  with pytest.raises(ValueError, match=r"request 'f': prompt: token ids must be integers, got 2.5"):
    engine.submit([1, 2.5], max_new_tokens=5, request_id="f")
  with pytest.raises(ValueError, match=r"eos_token_ids outside \[0, 256\): \[256\]"):
    Engine(model, slots=1, max_length=64, eos_token_ids=[256])
  with pytest.raises(ValueError, match=r"max_seqs \(formerly slots\) must be >= 1"):
    Engine(model, slots=0, max_length=64)
  with pytest.raises(ValueError, match="max_length must be in"):
    Engine(model, slots=1, max_length=10**6)
  assert list(engine.run()) == []


def test_one_prefill_admits_several_requests_padding_rows_dropped(model, ids):
  # 3 requests into 4 free slots: one prefill of 4 rows (the 4th a dropped pad row); the idle 4th slot decodes
  # into a row nobody reads.
  engine = Engine(model, slots=4, max_length=256, eos_token_ids=(), steps_per_call=2)
  prompts = [ids[0, :90].tolist(), ids[1, :17].tolist(), ids[1, 40:140].tolist()]
  for i, p in enumerate(prompts):
    engine.submit(p, max_new_tokens=5 + i, request_id=i)
  done = {c.request_id: c.tokens.tolist() for c in engine.run()}
  assert engine.prefills == 1 and engine.admitted == 3
  for i, p in enumerate(prompts):
    assert done[i] == _alone(model, p, 5 + i, ())


@pytest.mark.quick
def test_stream_yields_each_requests_tokens_call_by_call(model, ids):
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(), steps_per_call=3)
  budgets = {"a": 7, "b": 4, "c": 5}
  for (name, n), p in zip(budgets.items(), (ids[0, :50], ids[1, :30], ids[0, 70:120])):
    engine.submit(p.tolist(), max_new_tokens=n, request_id=name)
  pieces, completions = {k: [] for k in budgets}, {}
  for update in engine.stream():
    assert 1 <= len(update.new_tokens) <= 3 and update.request_id not in completions
    pieces[update.request_id].append(update.new_tokens.tolist())
    if update.completion is not None:
      completions[update.request_id] = update.completion
  for name, n in budgets.items():
    assert [len(p) for p in pieces[name]] == [3] * (n // 3) + ([n % 3] if n % 3 else [])
    assert sum(pieces[name], []) == completions[name].tokens.tolist()


def test_per_row_filtering_equals_the_scalar_sampler():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from m3jax.sampling import SamplingParams, filtered_logits, filtered_logits_rows  # pylint: disable=g-import-not-at-top

  logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)) * 3, jnp.float32)
  params = [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (0.5, 10, 0.6), (0.0, 0, 1.0)]
  rows = filtered_logits_rows(logits, jnp.asarray([p[0] for p in params]), jnp.asarray([p[1] for p in params]),
                              jnp.asarray([p[2] for p in params]))
  for b, (t, k, p) in enumerate(params[:4]):
    want = filtered_logits(logits[b:b + 1], SamplingParams(temperature=t, top_k=k, top_p=p))[0]
    np.testing.assert_allclose(np.asarray(rows[b]), np.asarray(want), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(rows[4]), np.asarray(logits[4]))  # greedy row: untouched


def test_sampled_requests_do_not_depend_on_the_schedule(model, ids):
  a = dict(prompt=ids[0, :40].tolist(), temperature=0.9, top_p=0.95, seed=11)
  b = dict(prompt=ids[1, :25].tolist(), temperature=1.2, top_k=20, seed=12)

  def serve(slots, steps, requests):
    engine = Engine(model, slots=slots, max_length=128, eos_token_ids=(), steps_per_call=steps)
    for name, r in requests:
      engine.submit(r["prompt"], max_new_tokens=10, request_id=name,
                    **{k: v for k, v in r.items() if k != "prompt"})
    return {c.request_id: c.tokens.tolist() for c in engine.run()}

  alone = serve(1, 1, [("a", a)])["a"]
  together = serve(3, 3, [("g", dict(prompt=ids[0, 60:90].tolist())), ("b", b), ("a", a)])
  assert together["a"] == alone
  assert together["b"] == serve(1, 2, [("b", b)])["b"]
  assert together["a"] != serve(1, 1, [("a", dict(a, seed=13))])["a"]  # the seed matters
  assert together["g"] == _alone(model, ids[0, 60:90].tolist(), 10, ())  # greedy beside sampled rows
  with pytest.raises(ValueError, match="request 'x': top_p must be in"):
    Engine(model, slots=1, max_length=64).submit([1], max_new_tokens=1, request_id="x", top_p=1.5)


def test_cancel_frees_a_running_slot_and_drops_a_waiting_request(model, ids):
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(), steps_per_call=2)
  prompts = {"long": ids[0, :40], "waiting": ids[1, :30], "other": ids[1, :50], "next": ids[0, 10:60]}
  for name in ("long", "other", "waiting", "next"):  # "long" and "other" take the two slots
    engine.submit(prompts[name].tolist(), max_new_tokens=40, request_id=name)
  got: dict[str, list] = {}
  done = {}
  for update in engine.stream():
    got.setdefault(update.request_id, []).extend(update.new_tokens.tolist())
    if update.request_id == "long" and len(got["long"]) == 4 and update.completion is None:
      engine.cancel("long")  # its slot goes to "next", since "waiting" is cancelled before it is admitted
      engine.cancel("waiting")
      engine.cancel("no-such-request")  # ignored
    if update.completion is not None:
      done[update.request_id] = update.completion
  assert sorted(done) == ["long", "next", "other", "waiting"]
  assert done["long"].finish_reason == "cancelled" and done["long"].tokens.tolist() == got["long"]
  assert got["long"] == _alone(model, prompts["long"].tolist(), 4, ())  # the tokens it had, nothing after
  assert done["waiting"].finish_reason == "cancelled" and done["waiting"].tokens.size == 0
  assert engine.admitted == 3  # "waiting" never took a slot
  for name in ("other", "next"):  # the others are untouched and run to their budget
    assert done[name].finish_reason == "length"
    assert done[name].tokens.tolist() == _alone(model, prompts[name].tolist(), 40, ()), name
  # "long" stopped after its cancel at 4 tokens: with 2 steps per call and one call in flight, it held its slot
  # for at most 3 calls, so "next" finished well before the 2 x 20 calls two full requests would take.
  assert engine.decode_calls <= 3 + 20 + 1


def test_logprobs_equal_scoring_the_completion_and_top_tokens_are_sorted(model, ids):
  from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

  prompts = [ids[0, :40].tolist(), ids[1, :25].tolist(), ids[0, 60:90].tolist()]
  engine = Engine(model, slots=2, max_length=128, eos_token_ids=(), steps_per_call=3, logprobs=True,
                  top_logprobs=4, temperature=1.0, seed=3)  # sampled: the chosen token is not always the top one
  for i, p in enumerate(prompts):
    engine.submit(p, max_new_tokens=7, request_id=i)
  tops: dict[int, list] = {i: [] for i in range(3)}
  done = {}
  for update in engine.stream():
    assert update.logprobs.shape == update.new_tokens.shape
    tops[update.request_id].append(update.top_logprobs)
    if update.completion is not None:
      done[update.request_id] = update.completion
  for i, p in enumerate(prompts):
    c = done[i]
    scored = token_logprobs(model, [p + c.tokens.tolist()])
    # The engine's log-probability of each token it drew equals scoring the finished sequence in one forward.
    np.testing.assert_allclose(c.logprobs, scored.logprobs[0, len(p):len(p) + len(c.tokens)], atol=2e-4)
    top_ids = np.concatenate([t.ids for t in tops[i]])
    top_lp = np.concatenate([t.logprobs for t in tops[i]])
    assert top_ids.shape == (7, 4) and np.all(np.diff(top_lp, axis=1) <= 0)
    assert np.all(top_lp[:, 0] >= c.logprobs - 1e-5)  # nothing beats the most likely token
    listed = top_ids == c.tokens[:, None]  # where the drawn token is among the top 4, its value is the same
    np.testing.assert_allclose(top_lp[listed], np.repeat(c.logprobs, 4).reshape(7, 4)[listed], atol=1e-6)
  assert any(not np.all(done[i].tokens == np.concatenate([t.ids for t in tops[i]])[:, 0]) for i in range(3))
  with pytest.raises(ValueError, match="needs logprobs=True"):
    Engine(model, slots=1, max_length=64, top_logprobs=2)


# Faults stay local (#45): one request's failure ends that request alone, and the engine keeps serving.


def _simulated_oom(real, min_width):
  """_admit_jit that fails like an out-of-memory compile for prompt buckets of at least ``min_width``."""

  def admit(graph, params, prompts, *args, **kwargs):
    if prompts.shape[1] >= min_width:
      raise RuntimeError(f"RESOURCE_EXHAUSTED: simulated out of memory for a [{prompts.shape[0]}, "
                         f"{prompts.shape[1]}] prefill")
    return real(graph, params, prompts, *args, **kwargs)

  return admit


def test_a_failed_prefill_fails_its_request_alone(model, ids, monkeypatch):
  import m3jax.engine as engine_module  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(engine_module, "_admit_jit", _simulated_oom(engine_module._admit_jit, 128))
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(), steps_per_call=3)
  engine.submit(ids[0, :100].tolist(), max_new_tokens=4, request_id="long")  # bucket 128: its prefill fails
  engine.submit(ids[1, :50].tolist(), max_new_tokens=5, request_id="short")  # admitted with it, retried alone
  done = {c.request_id: c for c in engine.run()}
  assert done["long"].finish_reason == "error" and "RESOURCE_EXHAUSTED: simulated" in done["long"].error
  assert done["long"].tokens.size == 0
  assert done["short"].finish_reason == "length" and done["short"].error is None
  assert done["short"].tokens.tolist() == _alone(model, ids[1, :50].tolist(), 5, ())
  assert engine.broken is None
  engine.submit(ids[0, :40].tolist(), max_new_tokens=4, request_id="later")  # the engine goes on serving
  assert [c.tokens.tolist() for c in engine.run()] == [_alone(model, ids[0, :40].tolist(), 4, ())]


def test_a_parameter_that_does_not_fit_int32_fails_its_request_alone(model, ids):
  """The #45 failure (top_k 2**31 reaching the engine's int32 arrays broke every later call), here with the
  engine's own check bypassed: that request fails, its slot is freed, the other request runs."""
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(), steps_per_call=3)
  engine.submit(ids[0, :50].tolist(), max_new_tokens=4, request_id="bad", temperature=1.0, top_k=5)
  engine.submit(ids[1, :50].tolist(), max_new_tokens=5, request_id="good")
  object.__setattr__(engine._waiting[0].sampling, "top_k", 2**31)  # pylint: disable=protected-access
  done = {c.request_id: c for c in engine.run()}
  assert done["bad"].finish_reason == "error" and "2147483648 out of bounds for int32" in done["bad"].error
  assert done["good"].tokens.tolist() == _alone(model, ids[1, :50].tolist(), 5, ())
  assert all(s is None for s in engine._slots)  # pylint: disable=protected-access


def test_a_failed_decode_call_fails_its_requests_and_lost_state_is_rebuilt(model, ids, monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  import m3jax.engine as engine_module  # pylint: disable=g-import-not-at-top
  from m3jax.engine import EngineBroken  # pylint: disable=g-import-not-at-top
  from m3jax.generate import Decoder  # pylint: disable=g-import-not-at-top

  real, calls = engine_module._steps_jit, []

  def steps(graph, params, decode_weights, logits, caches, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # a device fault after the call consumed (donated) the batch state
      for x in jax.tree.leaves((logits, caches)):
        x.delete()
      raise RuntimeError("INTERNAL: simulated device fault")
    return real(graph, params, decode_weights, logits, caches, *args, **kwargs)

  monkeypatch.setattr(engine_module, "_steps_jit", steps)
  engine = Engine(model, slots=2, max_length=256, eos_token_ids=(), steps_per_call=3)
  prompts = {"a": ids[0, :50], "b": ids[1, :30], "c": ids[0, :40]}
  for name, p in prompts.items():  # "c" waits for a slot
    engine.submit(p.tolist(), max_new_tokens=4, request_id=name)
  done = {c.request_id: c for c in engine.run()}
  for name in ("a", "b"):  # decoded by the failed call
    assert done[name].finish_reason == "error" and "simulated device fault" in done[name].error
  assert done["c"].tokens.tolist() == _alone(model, prompts["c"].tolist(), 4, ())  # after the rebuild
  assert engine.broken is None
  # When the state cannot be rebuilt either, the engine says it is broken instead of failing each request.
  calls.clear()
  monkeypatch.setattr(Decoder, "init_paged_caches", lambda self, *a: (_ for _ in ()).throw(MemoryError("no memory")))
  engine.submit(prompts["a"].tolist(), max_new_tokens=6, request_id="d")
  with pytest.raises(EngineBroken, match="could not be rebuilt .*MemoryError: no memory"):
    list(engine.run())
  assert "simulated device fault" in engine.broken
  with pytest.raises(EngineBroken):
    engine.submit([1], max_new_tokens=1) or list(engine.stream())


def test_api_errors_are_clear(model, ids):
  """#45: model(zeros((0, 4))), generate(model, [1, 2, 3]) and max_new_tokens=2.5 gave cryptic errors."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from m3jax.generate import generate_stream  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match=r"input_ids has shape \(0, 4\); it needs at least one sequence"):
    model(jnp.zeros((0, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"got a flat list of ids \[1, 2, 3\]; for one prompt write \[\[...\]\]"):
    generate(model, [1, 2, 3], max_new_tokens=2)
  for fn in (generate, lambda *a, **k: next(generate_stream(*a, **k))):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer, got 2\.5 \(float\)"):
      fn(model, [[1, 2, 3]], max_new_tokens=2.5)
  engine = Engine(model, slots=1, max_length=64)
  for kwargs, message in (({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer, got 2\.5"),
                          ({"max_new_tokens": 2, "top_k": 2**31}, r"top_k must be an integer >= 0 and <= 2147483647"),
                          ({"max_new_tokens": 2, "seed": 2**31}, r"seed must be an integer in \[0, 2\*\*31\)"),
                          ({"max_new_tokens": 2, "temperature": 1e39}, "temperature must be a finite float32")):
    with pytest.raises(ValueError, match=message):
      engine.submit([1, 2], request_id="r", **kwargs)
