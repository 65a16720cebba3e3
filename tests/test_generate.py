"""Generation: cached decode == full forward, HF greedy parity, batching, compile reuse, sampling, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from conftest import FIXTURES
from m3jax.generate import (_decode_step_jit, _generate_jit, _sample_decode_jit, bucket_length, generate,
                            generate_stream, prefill, token_buffer_width)
from m3jax.sampling import SamplingParams, sample
from program_walk import concatenates, hlo_computations, loop_body_computations

HF_FIXTURES = ["legacy_b128", "flat_local2_b128", "flat_b16"]


@pytest.fixture(scope="module")
def models():
  return {n: m3jax.load(FIXTURES / n / "checkpoint", kernels="reference") for n in HF_FIXTURES}


def _prompts(name):
  ref = np.load(FIXTURES / name / "reference.npz")
  return ref, [ref["input_ids"][b, : ref["gen_prompt_lens"][b]].tolist() for b in range(2)]


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_greedy_tokens_equal_hf_generate(models, name):
  ref, prompts = _prompts(name)
  out = generate(models[name], prompts, max_new_tokens=48, eos_token_ids=())
  assert out.tokens.shape == (2, 48)
  np.testing.assert_array_equal(out.tokens, ref["gen_tokens"])
  np.testing.assert_array_equal(out.lengths, [48, 48])


@pytest.mark.parametrize("name, prompt_len", [("legacy_b128", 240), ("flat_b16", 150)])
def test_cached_decode_reproduces_full_forward_logits(models, name, prompt_len):
  model = models[name]
  cfg = model.config.text
  prompt = np.load(FIXTURES / name / "reference.npz")["input_ids"][0, :prompt_len].tolist()
  new = generate(model, [prompt], max_new_tokens=48, eos_token_ids=()).tokens[0].tolist()
  total = len(prompt) + len(new)
  # The selection must change during decode: the sequence crosses blocks and exceeds top_k x block_size.
  assert total > cfg.index_topk_blocks * cfg.index_block_size
  assert total // cfg.index_block_size > len(prompt) // cfg.index_block_size
  caches = model.init_caches(1, 512)
  pos = jnp.arange(total, dtype=jnp.int32)[None]
  ids = jnp.asarray([prompt + new], jnp.int32)
  forward = jax.jit(lambda t, p, c: model.forward(t, positions=p, caches=c))  # programs, not op by op (eager)
  out = forward(ids[:, : len(prompt)], pos[:, : len(prompt)], caches)
  step_logits, caches = [out.logits[:, -1]], out.caches
  for i in range(len(prompt), total - 1):
    out = forward(ids[:, i:i + 1], pos[:, i:i + 1], caches)
    step_logits.append(out.logits[:, 0])
    caches = out.caches
  full = model(ids)[0, len(prompt) - 1: total - 1]
  got = jnp.concatenate(step_logits)
  err = float(jnp.max(jnp.abs(got - full)) / jnp.max(jnp.abs(full)))
  assert err <= 1e-4, err


def test_batch_of_three_prompts_equals_each_alone(models):
  model = models["flat_b16"]
  ids = np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]
  prompts = [ids[0, :150].tolist(), ids[1, :37].tolist(), ids[0, 60:141].tolist()]
  batch = generate(model, prompts, max_new_tokens=24, eos_token_ids=())
  for i, p in enumerate(prompts):
    alone = generate(model, [p], max_new_tokens=24, eos_token_ids=())
    np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])


def test_prompts_in_the_same_bucket_compile_once(models):
  model = models["flat_b16"]
  ids = np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]
  assert bucket_length(70) == bucket_length(100) == 128
  _generate_jit.clear_cache()  # other tests' programs (read back from the persistent cache when needed again)
  generate(model, [ids[0, :70].tolist()], max_new_tokens=5)
  assert _generate_jit._cache_size() == 1
  generate(model, [ids[1, :100].tolist()], max_new_tokens=5)
  generate(model, [ids[0, 3:99].tolist()], max_new_tokens=5, seed=3)
  assert _generate_jit._cache_size() == 1
  # max_new_tokens is traced: 5 and 12 share a token buffer (token_buffer_width) and a cache length
  assert token_buffer_width(5) == token_buffer_width(12) == 32 and token_buffer_width(33) == 64
  out = generate(model, [ids[1, :100].tolist()], max_new_tokens=12, eos_token_ids=())
  assert _generate_jit._cache_size() == 1 and out.tokens.shape == (1, 12) and out.lengths.tolist() == [12]
  generate(model, [ids[0, :140].tolist()], max_new_tokens=5)  # next bucket: one more compile
  assert _generate_jit._cache_size() == 2


@pytest.mark.parametrize("steps_per_call", [1, 5])  # 5: calls of 5, 5 and 2 steps
def test_stream_yields_the_same_tokens(models, steps_per_call):
  model = models["legacy_b128"]
  _, prompts = _prompts("legacy_b128")
  streamed = np.stack(list(generate_stream(model, prompts, max_new_tokens=12, eos_token_ids=(),
                                           steps_per_call=steps_per_call, temperature=0.8, seed=3)), axis=1)
  expected = generate(model, prompts, max_new_tokens=12, eos_token_ids=(), temperature=0.8, seed=3).tokens
  np.testing.assert_array_equal(streamed, expected)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_stream_stops_like_generate(models, steps_per_call):
  """Stopped sequences yield -1, and the stream ends once every sequence has stopped (mid-call too)."""
  model = models["flat_b16"]
  ref, prompts = _prompts("flat_b16")
  stops = [int(ref["gen_tokens"][0, 2]), int(ref["gen_tokens"][1, 4])]
  out = generate(model, prompts, max_new_tokens=16, eos_token_ids=stops)
  streamed = np.stack(list(generate_stream(model, prompts, max_new_tokens=16, eos_token_ids=stops,
                                           steps_per_call=steps_per_call)), axis=1)
  assert streamed.shape[1] == out.lengths.max() < 16
  after_stop = np.arange(streamed.shape[1])[None] >= out.lengths[:, None]
  assert after_stop.any()
  np.testing.assert_array_equal(streamed, np.where(after_stop, -1, out.tokens[:, :streamed.shape[1]]))


def test_stream_calls_share_one_compile_and_yield_exactly_max_new_tokens(models):
  """With room in the cache every call runs steps_per_call steps (12 tokens as 7 + 7: one compile, 2 tokens not
  yielded); a cache without room for a full last call gets a shorter one (60 tokens after a 300-token prompt in
  a 384-slot cache: 50 + 10, a second compile)."""
  model = models["legacy_b128"]
  _, prompts = _prompts("legacy_b128")
  before = _sample_decode_jit._cache_size()
  streamed = np.stack(list(generate_stream(model, prompts, max_new_tokens=12, eos_token_ids=(), steps_per_call=7)),
                      axis=1)
  assert _sample_decode_jit._cache_size() == before + 1
  np.testing.assert_array_equal(streamed, generate(model, prompts, max_new_tokens=12, eos_token_ids=()).tokens)
  longest = max(len(p) for p in prompts)
  assert longest == 300  # cache: 300 + 60 slots rounded up to 384, room for 84 steps
  before = _sample_decode_jit._cache_size()
  tight = np.stack(list(generate_stream(model, prompts, max_new_tokens=60, eos_token_ids=(), steps_per_call=50,
                                        max_length=longest + 60)), axis=1)
  assert _sample_decode_jit._cache_size() == before + 2  # calls of 50 and 10 steps
  np.testing.assert_array_equal(tight, generate(model, prompts, max_new_tokens=60, eos_token_ids=()).tokens)


@pytest.mark.quick
def test_stream_rejects_a_bad_steps_per_call(models):
  with pytest.raises(ValueError, match="steps_per_call must be >= 1"):
    next(generate_stream(models["flat_b16"], [[1, 2, 3]], max_new_tokens=4, steps_per_call=0))


@pytest.mark.quick
def test_eos_stops_a_sequence_and_pads(models):
  model = models["flat_b16"]
  ref, prompts = _prompts("flat_b16")
  stop = int(ref["gen_tokens"][0, 5])
  first = int(np.argmax(ref["gen_tokens"][0] == stop))  # first occurrence (<= 5)
  out = generate(model, prompts, max_new_tokens=16, eos_token_ids=[stop], pad_token_id=0)
  assert out.lengths[0] == first + 1
  np.testing.assert_array_equal(out.tokens[0, : first + 1], ref["gen_tokens"][0, : first + 1])
  assert (out.tokens[0, first + 1:] == 0).all()


def test_sampling_is_seeded_and_reduces_to_greedy():
  logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
  greedy = sample(logits, jax.random.key(1), SamplingParams())
  np.testing.assert_array_equal(sample(logits, jax.random.key(1), SamplingParams(temperature=1.0, top_k=1)), greedy)
  np.testing.assert_array_equal(sample(logits, jax.random.key(2), SamplingParams(temperature=1.0, top_p=1e-6)),
                                greedy)
  p = SamplingParams(temperature=1.0, top_k=10, top_p=0.9)
  draws = [np.asarray(sample(logits, jax.random.key(s), p)) for s in range(20)]
  np.testing.assert_array_equal(draws[0], np.asarray(sample(logits, jax.random.key(0), p)))
  assert len({d.tobytes() for d in draws}) > 1
  top10 = np.argsort(-np.asarray(logits), axis=-1)[:, :10]
  assert all(d[r] in top10[r] for d in draws for r in range(4))


def test_sampled_generation_is_reproducible(models):
  model = models["flat_b16"]
  _, prompts = _prompts("flat_b16")
  a = generate(model, prompts, max_new_tokens=8, temperature=0.8, top_k=20, seed=7, eos_token_ids=())
  b = generate(model, prompts, max_new_tokens=8, temperature=0.8, top_k=20, seed=7, eos_token_ids=())
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_cache_length_is_block_aligned_under_max_length(models):
  # A cache of max_length slots is rounded up to whole 128-key blocks (an unaligned one would be padded,
  # i.e. copied, by the attention kernels at every decode step).
  model = models["flat_b16"]
  for new, max_length, slots in ((10, 100, 128), (90, 200, 256), (90, None, 256)):
    out = prefill(model, [[1] * 50], max_new_tokens=new, max_length=max_length)
    assert out.caches[0].k.shape[1] == slots, (new, max_length, out.caches[0].k.shape)


@pytest.mark.quick
def test_too_long_requests_fail_before_compute(models):
  model = models["flat_b16"]
  with pytest.raises(ValueError, match="longer than the cache"):
    generate(model, [[1] * 100], max_new_tokens=4, max_length=64)
  with pytest.raises(ValueError, match="exceeds the cache"):
    generate(model, [[1] * 60], max_new_tokens=10, max_length=64)
  with pytest.raises(ValueError, match="at least one token"):
    generate(model, [[1, 2], []], max_new_tokens=4)
  with pytest.raises(ValueError, match="top_p"):
    generate(model, [[1, 2]], max_new_tokens=4, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match=r"outside \[0, \d+\): min -2, max -2"):  # the padding is not reported
    generate(model, [[-2]], max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt 0: token ids must be integers, got 1.5"):
    generate(model, [[1.5, 2]], max_new_tokens=4)
  vocab = model.config.text.vocab_size
  with pytest.raises(ValueError, match=rf"eos_token_ids outside \[0, {vocab}\)"):
    generate(model, [[1, 2]], max_new_tokens=4, eos_token_ids=[vocab])


def test_multimodal_generation_follows_the_full_multimodal_forward():
  ref = np.load(FIXTURES / "vl_tiny" / "reference.npz")
  model = m3jax.load(FIXTURES / "vl_tiny" / "checkpoint", kernels="reference")
  pixels = {k: ref[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  prompt = ref["input_ids"]
  embeds = model.embed_multimodal(prompt, **pixels)
  out = generate(model, prompt, max_new_tokens=6, eos_token_ids=(), prompt_embeds=embeds)
  # Teacher-forced check: the multimodal forward over prompt + generated tokens predicts each generated token.
  full = np.asarray(model(np.concatenate([prompt, out.tokens[:, :-1]], axis=1), **pixels))
  np.testing.assert_array_equal(full[0, prompt.shape[1] - 1:].argmax(-1), out.tokens[0])
  with pytest.raises(ValueError, match=r"placeholder tokens \[250, 251\] but no image or video was given"):
    generate(model, prompt, max_new_tokens=6, eos_token_ids=())  # placeholders without their pixels (#45)
  as_text = model.embed_tokens(jnp.asarray(prompt))  # the placeholders' own token embeddings, explicitly
  text_only = generate(model, prompt, max_new_tokens=6, eos_token_ids=(), prompt_embeds=as_text)
  assert not np.array_equal(text_only.tokens, out.tokens)  # the images really reach the prefill
  # A chunked prefill (194 tokens -> bucket 256, 4 chunks of 64) cuts the embeddings with the ids.
  chunked = generate(model, prompt, max_new_tokens=6, eos_token_ids=(), prompt_embeds=embeds, prefill_chunk=64)
  np.testing.assert_array_equal(chunked.tokens, out.tokens)
  with pytest.raises(ValueError, match="prompt_embeds has shape"):
    generate(model, prompt, max_new_tokens=2, prompt_embeds=embeds[:, :, :8][None])


def test_prefill_and_decode_step_reproduce_generate(models):
  model = models["flat_b16"]
  _, prompts = _prompts("flat_b16")
  state = m3jax.prefill(model, prompts, max_new_tokens=10)
  caches, tokens = state.caches, []
  tok = np.asarray(jnp.argmax(state.logits, -1), np.int32)
  for step in range(10):
    tokens.append(tok)
    logits, caches = m3jax.decode_step(model, tok, state.lengths + step, caches)
    tok = np.asarray(jnp.argmax(logits, -1), np.int32)
  np.testing.assert_array_equal(np.stack(tokens, 1),
                                generate(model, prompts, max_new_tokens=10, eos_token_ids=()).tokens)
  with pytest.raises(ValueError, match=r"positions span \[10000, 10000\]: outside the cache"):
    m3jax.decode_step(model, tok, np.full(2, 10_000), caches)
  with pytest.raises(ValueError, match=r"positions span \[-1, "):
    m3jax.decode_step(model, tok, np.asarray([-1, 3]), caches)
  with pytest.raises(ValueError, match="3 tokens for caches of 2 sequences"):
    m3jax.decode_step(model, np.zeros(3, np.int32), np.zeros(3, np.int32), caches)
  # The model's own forward checks the same on concrete inputs (the cache write would drop them silently).
  length = caches[0].max_length
  with pytest.raises(ValueError, match=rf"positions span \[{length}, {length + 1}\] but the caches hold positions "
                                       rf"\[0, {length}\)"):
    model.forward(jnp.ones((2, 2), jnp.int32), positions=jnp.full((2, 2), length) + jnp.arange(2), caches=caches)
  with pytest.raises(ValueError, match="layer 0's cache holds 2 sequences but the input has 1"):
    model.forward(jnp.ones((1, 2), jnp.int32), positions=jnp.zeros((1, 2), jnp.int32), caches=caches)


def test_decoder_steps_reproduce_generate_and_compile_once(models):
  """A Decoder made once drives the same tokens as generate; a second Decoder of the same model (or a
  decode_step call) reuses the compiled step instead of recompiling."""
  from m3jax.generate import _decode_step_jit

  model = models["flat_b16"]
  _, prompts = _prompts("flat_b16")
  state = m3jax.prefill(model, prompts, max_new_tokens=6)
  decoder = m3jax.Decoder.of(model)
  caches, tokens = state.caches, []
  tok = np.asarray(jnp.argmax(state.logits, -1), np.int32)
  for step in range(6):
    tokens.append(tok)
    logits, caches = decoder.step(tok, state.lengths + step, caches)
    tok = np.asarray(jnp.argmax(logits, -1), np.int32)
  np.testing.assert_array_equal(np.stack(tokens, 1),
                                generate(model, prompts, max_new_tokens=6, eos_token_ids=()).tokens)
  compiled = _decode_step_jit._cache_size()
  again = m3jax.Decoder.of(model)
  assert again.graph == decoder.graph and again.graph is not decoder.graph
  logits, caches = again.step(tok, state.lengths + 6, caches)
  logits, caches = m3jax.decode_step(model, tok, state.lengths + 7, caches)
  assert _decode_step_jit._cache_size() == compiled
  with pytest.raises(ValueError, match=r"must both be \[batch\]"):
    decoder.step(tok[None], state.lengths[None], caches)


def _weight_concats(jaxpr, hidden: int) -> list[tuple[int, bool]]:
  """(width, inside a while loop?) of every concatenate producing a [hidden, width] array in a jaxpr, nested
  jaxprs (jit, shard_map, loops, branches) included."""
  found = concatenates(jaxpr, lambda aval: len(aval.shape) == 2 and aval.shape[0] == hidden)
  return [(aval.shape[1], inside) for aval, inside in found]


def test_decode_loops_fuse_the_projection_weights_once_outside_the_loop():
  """Each layer's projections are one GEMM over its weights concatenated (m3jax.parallel.projection). The
  decode loops of generate and of generate_stream's multi-step calls build these concatenations once, before
  the loop, in the program itself: XLA:GPU keeps a concatenation written inside the loop body in the body
  (the H200's compiled loop did, eleventh session), so it must not be left to the compiler."""
  model = m3jax.M3ForCausalLM(m3jax.config.tiny(), dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
  t = model.config.text
  graphdef, state = nnx.split(model)
  qkv = (t.num_heads + 2 * t.num_kv_heads) * t.head_dim
  by_layer = [qkv + (t.index_num_heads + 1) * t.index_head_dim * (kind == "sparse") for kind in t.attention_types]
  expected = sorted(by_layer)
  generate_args = (graphdef, state, jnp.ones((2, 16), jnp.int32), jnp.asarray([16, 12], jnp.int32),
                   jax.random.key(0), jnp.asarray([2], jnp.int32), jnp.int32(0), None, jnp.int32(4))
  generate_kw = dict(width=32, sampling=SamplingParams(), cache_len=128)
  found = _weight_concats(_generate_jit.trace(*generate_args, **generate_kw).jaxpr.jaxpr, t.hidden_size)
  in_loop = [width for width, inside in found if inside]
  assert not in_loop, f"[{t.hidden_size}, width] weight concatenations inside generate's decode loop: {in_loop}"
  # once for the prefill and once, before the loop, for the decode steps
  assert sorted(width for width, _ in found) == sorted(expected * 2)

  # A Decoder (generate_stream, decode_step) fuses them in a program of their own, once, and its step programs
  # take them as arguments.
  decoder = m3jax.Decoder.of(model)
  assert decoder.decode_weights is decoder.decode_weights
  assert [p.projection.weight.shape for p in decoder.decode_weights] == [(t.hidden_size, w) for w in by_layer]
  assert all(p.experts is None for p in decoder.decode_weights)  # reference path: nothing to prepare
  caches = model.init_caches(2, 128)
  positions = jnp.asarray([16, 12], jnp.int32)
  steps = _sample_decode_jit.trace(decoder.graph, decoder.params, decoder.decode_weights, jnp.zeros((2, t.vocab_size)),
                                   caches, positions, jax.random.key(0), sampling=SamplingParams(), num_steps=3)
  one = _decode_step_jit.trace(decoder.graph, decoder.params, decoder.decode_weights, positions, positions, caches)
  assert _weight_concats(steps.jaxpr.jaxpr, t.hidden_size) == []
  assert _weight_concats(one.jaxpr.jaxpr, t.hidden_size) == []

  # ... and the compiler keeps them there (no computation reachable from the while body concatenates them).
  # Only these widths: XLA:GPU's dot merger also joins, per step, other dots of one input in this fp32 model
  # (the router's and the shared expert's: [64, 8 + 64]); BENCHMARKS.md notes it.
  hlo = _generate_jit.lower(*generate_args, **generate_kw).compile().as_text()
  comps = hlo_computations(hlo)
  loop_comps = loop_body_computations(hlo, comps)
  assert loop_comps, "no while loop found in the compiled generate program"
  for name, text in comps.items():
    for width in re.findall(rf"= f32\[{t.hidden_size},(\d+)\]\{{[^}}]*\}} concatenate\(", text):
      assert int(width) not in expected or name not in loop_comps, \
          f"the [{t.hidden_size}, {width}] projection weight concatenation runs per step"


@pytest.mark.parametrize("name, chunk", [("flat_b16", 16), ("legacy_b128", 32)])
def test_chunked_prefill_equals_one_shot(models, name, chunk):
  """Prefill in chunks (each attending to the cache of the ones before) == one forward over the prompt bucket:
  last-token logits and every cache entry of the prompts, then the same generated tokens, also streamed."""
  model = models[name]
  _, prompts = _prompts(name)
  prompts = prompts + [prompts[0][:3]]  # a row that ends in the first chunk
  whole = prefill(model, prompts, max_new_tokens=8)
  chunked = prefill(model, prompts, max_new_tokens=8, prefill_chunk=chunk)
  assert bucket_length(max(map(len, prompts))) >= 2 * chunk  # really chunked
  np.testing.assert_allclose(np.asarray(chunked.logits), np.asarray(whole.logits), rtol=1e-4, atol=1e-4)
  for a, b in zip(whole.caches, chunked.caches):
    for field in ("k", "v", "idx_k"):
      if getattr(a, field) is not None:
        for row, p in enumerate(prompts):
          np.testing.assert_allclose(np.asarray(getattr(b, field)[row, :len(p)]),
                                     np.asarray(getattr(a, field)[row, :len(p)]), rtol=1e-4, atol=1e-4)
  ref = generate(model, prompts, max_new_tokens=8, eos_token_ids=())
  np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=8, eos_token_ids=(), prefill_chunk=chunk).tokens,
                                ref.tokens)
  streamed = np.stack(list(generate_stream(model, prompts, max_new_tokens=8, eos_token_ids=(), prefill_chunk=chunk)), 1)
  np.testing.assert_array_equal(streamed, ref.tokens)
  for bad in (12, 8, 0):
    with pytest.raises(ValueError, match="prefill_chunk must be a power of two >= 16"):
      generate(model, prompts, max_new_tokens=2, prefill_chunk=bad)
