"""MTP modules and speculative decoding: the module's math, its checkpoint names, greedy token equality with
``generate`` (rejecting, partly accepting and fully accepting drafters), stop tokens, and the sampled
distribution against the target's exact one."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import m3jax
from m3jax.checkpoint.convert import convert
from m3jax.checkpoint.safetensors_dir import CheckpointError
from m3jax.checkpoint.writer import write_checkpoint
from m3jax.layers.norms import gemma_rms_norm
from m3jax.layers.rope import rope_cos_sin
from m3jax.sampling import SamplingParams, filtered_logits
from m3jax.speculative import generate_speculative, generate_speculative_stream

PROMPTS = [list(range(5, 45)), list(range(3, 20)), [44]]  # 40 / 17 / 1 tokens; block 16, top-2 blocks


def _model(seed: int = 0) -> m3jax.M3ForCausalLM:
  return m3jax.M3ForCausalLM(m3jax.tiny(mtp=True), dtype=jnp.float32, rngs=nnx.Rngs(seed), with_mtp=True,
                             kernels="reference")


def _scale(var, factor: float) -> None:
  var.set_value(var.get_value() * factor)


def _drafting_model(noise: float, seed: int = 0, mtp_layer_scale: float = 0.0) -> m3jax.M3ForCausalLM:
  """A target whose layers are scaled down (its next token depends mostly, not only, on the current token) and
  an MTP module that predicts from the next token's embedding alone (eh_proj ~ [I; 0], its layer silenced):
  with noise 0 it drafts what the target would say almost always; noise makes it err. ``mtp_layer_scale`` > 0
  lets the module's own attention and MoE contribute, scaled."""
  model = _model(seed)
  for layer in model.layers:
    _scale(layer.attn.o_proj, 0.3)
    if hasattr(layer.mlp, "w_down"):
      _scale(layer.mlp.w_down, 0.3)
      _scale(layer.mlp.shared.down, 0.3)
    else:
      _scale(layer.mlp.down, 0.3)
  h = model.config.text.hidden_size
  eh = np.concatenate([np.eye(h), np.zeros((h, h))], 0)
  eh += noise * np.random.default_rng(seed).standard_normal((2 * h, h)) / np.sqrt(h)
  mtp = model.mtp[0]
  mtp.eh_proj.set_value(jnp.asarray(eh, jnp.float32))
  for var in (mtp.layer.attn.o_proj, mtp.layer.mlp.w_down, mtp.layer.mlp.shared.down):
    _scale(var, mtp_layer_scale)
  return model


@pytest.mark.quick
def test_mtp_forward_follows_the_spec():
  """logits = lm_head(final_norm(layer(eh_proj([enorm(e) ; hnorm(h)])))), e zeroed at position 0."""
  model = _model()
  mtp = model.mtp[0]
  for var in (mtp.enorm.weight, mtp.hnorm.weight, mtp.final_norm.weight):  # non-trivial norm weights
    var.set_value(jax.random.normal(jax.random.key(len(var.shape)), var.shape) * 0.3)
  b, s, h = 2, 7, model.config.text.hidden_size
  ids = jax.random.randint(jax.random.key(1), (b, s), 0, model.config.text.vocab_size)
  prev = jax.random.normal(jax.random.key(2), (b, s, h))
  positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14, 15]], jnp.int32)
  out = model.mtp_forward(ids, prev, positions=positions)

  eps = model.config.text.rms_norm_eps
  e = np.asarray(model.embed[...])[np.asarray(ids)]
  e[0, 0] = 0.0  # position 0 only (row 1 starts at position 9)
  joined = np.concatenate([np.asarray(gemma_rms_norm(jnp.asarray(e), mtp.enorm.weight[...], eps)),
                           np.asarray(gemma_rms_norm(prev, mtp.hnorm.weight[...], eps))], axis=-1)
  u = joined @ np.asarray(mtp.eh_proj[...])
  cos, sin = rope_cos_sin(positions, model.config.text.rotary_dim, model.config.text.rope_theta)
  layer_out, _, _ = mtp.layer(jnp.asarray(u), positions=positions, cos=cos, sin=sin, cache=None)
  logits = np.asarray(gemma_rms_norm(layer_out, mtp.final_norm.weight[...], eps)) @ np.asarray(model.lm_head[...])
  np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(layer_out), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=1e-4, atol=1e-4)
  # Position 0 ignores its token; other positions do not.
  other = ids.at[:, 0].set((ids[:, 0] + 1) % model.config.text.vocab_size)
  changed = model.mtp_forward(other, prev, positions=positions).logits
  np.testing.assert_array_equal(np.asarray(changed[0]), np.asarray(out.logits[0]))
  assert not np.allclose(np.asarray(changed[1, 0]), np.asarray(out.logits[1, 0]))


@pytest.mark.quick
def test_mtp_weights_round_trip_through_original_and_converted_checkpoints(tmp_path):
  model = _model()
  src = tmp_path / "src"
  write_checkpoint(model, src)
  h = model.config.text.hidden_size
  pre = "language_model.model.mtp.layers.0."
  with safe_open(str(src / "model.safetensors"), "np") as f:
    names = set(f.keys())
    eh = f.get_tensor(pre + "eh_proj.weight")
  for name in ("enorm.weight", "hnorm.weight", "final_layernorm.weight", "transformer_layer.input_layernorm.weight",
               "transformer_layer.self_attn.index_q_proj.weight", "transformer_layer.block_sparse_moe.gate.weight",
               "transformer_layer.block_sparse_moe.experts.7.w2.weight",
               "transformer_layer.block_sparse_moe.shared_experts.up_proj.weight"):
    assert pre + name in names, name
  assert eh.shape == (h, 2 * h)  # [out, in], like every checkpoint linear
  np.testing.assert_array_equal(eh.T, np.asarray(model.mtp[0].eh_proj[...]))

  expected = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  conv = tmp_path / "conv"
  convert(str(src), str(conv))
  for path in (src, conv):
    loaded = m3jax.load(path, with_mtp=True, kernels="reference")
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert got.keys() == expected.keys()
    for key, var in expected.items():
      np.testing.assert_array_equal(np.asarray(got[key].get_value()), np.asarray(var.get_value()), err_msg=str(key))
    assert m3jax.load(path, kernels="reference").mtp is None  # skipped by default

  no_mtp = tmp_path / "no_mtp"
  convert(str(src), str(no_mtp), keep_mtp=False)
  with pytest.raises(CheckpointError, match=r"no MTP tensor 'layers\.0\.[a-z_.]+'"):
    m3jax.load(no_mtp, with_mtp=True)


@pytest.mark.quick
def test_with_mtp_errors_name_the_problem(tmp_path):
  plain = m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
  write_checkpoint(plain, tmp_path / "plain")
  with pytest.raises(CheckpointError, match="num_mtp_modules = 0"):
    m3jax.load(tmp_path / "plain", with_mtp=True)
  with pytest.raises(ValueError, match="num_mtp_modules >= 1"):
    m3jax.M3ForCausalLM(m3jax.tiny(), with_mtp=True)
  with pytest.raises(ValueError, match="with_mtp=True"):
    generate_speculative(plain, [[1, 2, 3]], max_new_tokens=4)
  # A checkpoint whose config announces an MTP module that its tensors lack.
  model = _model()
  write_checkpoint(model, tmp_path / "full")
  os.makedirs(tmp_path / "cut")
  from safetensors.numpy import save_file
  with safe_open(str(tmp_path / "full" / "model.safetensors"), "np") as f:
    kept = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("mtp.layers.0.hnorm.weight")}
  save_file(kept, str(tmp_path / "cut" / "model.safetensors"))
  (tmp_path / "cut" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
  with pytest.raises(CheckpointError, match=r"missing tensor 'language_model\.model\.mtp\.layers\.0\.hnorm\.weight'"):
    m3jax.load(tmp_path / "cut", with_mtp=True)
  assert m3jax.load(tmp_path / "cut").mtp is None
  with pytest.raises(ValueError, match="num_draft_tokens"):
    generate_speculative(model, [[1, 2]], max_new_tokens=4, num_draft_tokens=0)


@pytest.mark.parametrize("noise, k, accepted", [(None, 2, "none"), (0.3, 1, "some"), (0.3, 3, "some"),
                                                (0.0, 3, "most")])
def test_greedy_speculative_tokens_equal_generate(noise, k, accepted):
  model = _model() if noise is None else _drafting_model(noise)
  ref = m3jax.generate(model, PROMPTS, max_new_tokens=40, eos_token_ids=())
  out = generate_speculative(model, PROMPTS, max_new_tokens=40, num_draft_tokens=k, eos_token_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, [40, 40, 40])
  rate = out.acceptance_rate
  if accepted == "none":  # a random MTP module: every draft rejected, one token per round
    assert rate < 0.05 and np.all(out.rounds >= 39)
  elif accepted == "some":  # partial acceptance: rounds keep some drafts and reject others
    assert 0.1 < rate < 0.9, rate
    assert np.all(out.rounds < 39)
  else:
    assert rate > 0.9 and out.tokens_per_round > 3.5, (rate, out.tokens_per_round)
  assert out.rounds.sum() * k >= out.accepted.sum()
  assert out.drafts.shape == (3, out.accepted_drafts.shape[1], k)


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_speculative_decoding():
  """The target's and the MTP's prefill in chunks of 16: the same tokens, drafts and acceptance, streamed too."""
  model = _drafting_model(0.1, mtp_layer_scale=0.5)
  ref = generate_speculative(model, PROMPTS, max_new_tokens=16, num_draft_tokens=2, eos_token_ids=())
  out = generate_speculative(model, PROMPTS, max_new_tokens=16, num_draft_tokens=2, eos_token_ids=(), prefill_chunk=16)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.drafts, ref.drafts)
  np.testing.assert_array_equal(out.accepted_drafts, ref.accepted_drafts)
  assert 0.2 < ref.acceptance_rate < 0.95  # the MTP's prefilled cache matters to the drafts
  chunks = list(generate_speculative_stream(model, PROMPTS, max_new_tokens=16, num_draft_tokens=2, eos_token_ids=(),
                                            prefill_chunk=16, rounds_per_call=2))
  for b in range(3):
    np.testing.assert_array_equal(np.concatenate([c[b] for c in chunks]), ref.tokens[b])


def test_speculative_stops_like_generate():
  model = _drafting_model(0.3)
  ref = m3jax.generate(model, PROMPTS, max_new_tokens=40, eos_token_ids=())
  stop = int(ref.tokens[0, 13])  # a token row 0 produces mid-way
  expect = m3jax.generate(model, PROMPTS, max_new_tokens=40, eos_token_ids=(stop,))
  assert expect.lengths[0] <= 14
  for k in (1, 3):
    out = generate_speculative(model, PROMPTS, max_new_tokens=40, num_draft_tokens=k, eos_token_ids=(stop,))
    np.testing.assert_array_equal(out.tokens, expect.tokens)
    np.testing.assert_array_equal(out.lengths, expect.lengths)
  short = generate_speculative(model, PROMPTS, max_new_tokens=5, num_draft_tokens=3, eos_token_ids=())
  np.testing.assert_array_equal(short.tokens, ref.tokens[:, :5])


def _exact_joint(model, prompt, sampling, steps):
  """The target's exact distribution of its first ``steps`` sampled tokens: {token tuple: probability}."""
  joint = {(): 1.0}
  last_probs = jax.jit(lambda ids: jax.nn.softmax(filtered_logits(model.forward(ids).logits[:, -1], sampling), -1))
  for _ in range(steps):
    nxt = {}
    seqs = list(joint)
    ids = jnp.asarray([prompt + list(s) for s in seqs], jnp.int32)
    probs = np.asarray(last_probs(ids))  # one program per step, not each op compiled on its own (eager)
    for seq, p_seq, row in zip(seqs, joint.values(), probs):
      for tok in np.flatnonzero(row > 1e-9):
        nxt[seq + (int(tok),)] = p_seq * float(row[tok])
    joint = nxt
  return joint


@pytest.mark.slow
def test_sampled_speculative_tokens_follow_the_target_distribution():
  """3 sampled tokens (top-3, temperature 1) of 4096 copies of a prompt, drafting 2 per round with an MTP module
  whose distribution differs from the target's: the empirical joint must match the target's exact joint (27
  outcomes), and must not match the distribution of always keeping the drafts."""
  model = _drafting_model(0.6)
  sampling = SamplingParams(temperature=1.0, top_k=3)
  prompt, n = [7, 99, 123, 5, 250, 31], 4096
  exact = _exact_joint(model, prompt, sampling, 3)
  out = generate_speculative(model, [prompt] * n, max_new_tokens=3, num_draft_tokens=2, temperature=1.0, top_k=3,
                             seed=3, eos_token_ids=())
  assert 0.1 < out.acceptance_rate < 0.9, out.acceptance_rate
  counts: dict[tuple, int] = {}
  for row in out.tokens:
    counts[tuple(int(t) for t in row)] = counts.get(tuple(int(t) for t in row), 0) + 1
  assert set(counts) <= set(exact), sorted(set(counts) - set(exact))[:3]
  tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())
  assert tv < 0.06, tv
  # The same check can fail: the drafts' own distribution (draft x_{L+1}, x_{L+2} from the MTP given the
  # target's x_L) is far from the target's.
  drafted = _drafted_joint(model, prompt, sampling)
  tv_drafts = 0.5 * sum(abs(drafted.get(s, 0.0) - exact.get(s, 0.0)) for s in set(drafted) | set(exact))
  assert tv_drafts > 0.2, tv_drafts


def _drafted_joint(model, prompt, sampling):
  """Distribution of (x_L, d_1, d_2) when x_L is the target's sample and d_1, d_2 the MTP's drafts (exact)."""
  out = jax.jit(model.forward)(jnp.asarray([prompt], jnp.int32))
  p0 = np.asarray(jax.nn.softmax(filtered_logits(out.logits[:, -1], sampling), axis=-1))[0]
  s = len(prompt)

  @jax.jit  # one program per sequence length (s, s + 1), not each op compiled on its own (eager)
  def mtp_last(ids, hidden):
    m = model.mtp_forward(ids, hidden, positions=jnp.arange(ids.shape[1], dtype=jnp.int32)[None])
    return jax.nn.softmax(filtered_logits(m.logits[:, -1], sampling), axis=-1)[0], m.hidden[:, -1:]

  joint = {}
  for x0 in np.flatnonzero(p0 > 1e-9):
    ids = jnp.asarray([prompt[1:] + [int(x0)]], jnp.int32)
    q1, h1 = mtp_last(ids, out.hidden)
    q1 = np.asarray(q1)
    for d1 in np.flatnonzero(q1 > 1e-9):
      ids2 = jnp.concatenate([ids, jnp.asarray([[int(d1)]], jnp.int32)], axis=1)
      hid2 = jnp.concatenate([out.hidden, h1], axis=1)
      q2 = np.asarray(mtp_last(ids2, hid2)[0])
      for d2, pr in itertools.product(np.flatnonzero(q2 > 1e-9), [p0[x0] * q1[d1]]):
        joint[(int(x0), int(d1), int(d2))] = pr * float(q2[d2])
  return joint


@pytest.mark.parametrize("drafter", ["random", "partly right"])
@pytest.mark.slow
def test_every_draft_equals_a_cache_free_mtp_chain(drafter):
  """Round r's drafts must be what the MTP module gives without caches: d_1 from x_1 .. x_p and the target's
  hidden states h_0 .. h_{p-1} of the final sequence, d_j from the chain extended by d_{j-1} and the module's own
  output. This checks the MTP caches (prefill, draft steps, catch-up over the verified positions) and their
  positions. Both drafters attend to every position; the second also gets drafts accepted (n > 0), whose
  positions the catch-up must rewrite from the target's hidden states."""
  model, k = (_model(), 2) if drafter == "random" else (_drafting_model(0.1, mtp_layer_scale=0.5), 2)
  out = generate_speculative(model, PROMPTS, max_new_tokens=24, num_draft_tokens=k, eos_token_ids=())
  if drafter != "random":
    assert 0.2 < out.acceptance_rate < 0.95, out.acceptance_rate
  width = 80  # every chain is padded to one width (causal: the padding does not reach the read position)
  mtp_step = jax.jit(lambda ids, hid, at: model.mtp_forward(ids, hid, positions=jnp.arange(width)[None],
                                                            logits_at=at))
  target_hidden = jax.jit(lambda ids: model.forward(ids).hidden)  # the target's sequences padded to width, too
  checked = 0
  for b, prompt in enumerate(PROMPTS):
    seq = prompt + out.tokens[b].tolist()
    hidden = np.asarray(target_hidden(jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)))[:, :len(seq)]
    p = len(prompt)
    for r in np.flatnonzero(out.accepted_drafts[b] >= 0)[:8]:
      ids, hid = np.zeros((1, width), np.int32), np.zeros((1, width, hidden.shape[-1]), np.float32)
      ids[0, :p], hid[0, :p] = seq[1:p + 1], hidden[0, :p]
      for j in range(k):
        step = mtp_step(jnp.asarray(ids), jnp.asarray(hid), jnp.asarray([p + j - 1], jnp.int32))
        draft = int(jnp.argmax(step.logits[0, 0]))
        assert draft == out.drafts[b, r, j], (b, r, j, draft, out.drafts[b, r])
        ids[0, p + j], hid[0, p + j] = draft, np.asarray(step.hidden[0, 0])
        checked += 1
      p += int(out.accepted_drafts[b, r]) + 1
  assert checked == 3 * 8 * k


@pytest.mark.parametrize("temperature, k, rounds_per_call", [(0.0, 2, 1), (0.0, 3, 3), (1.0, 2, 2)])
@pytest.mark.slow
def test_streamed_speculative_tokens_equal_generate_speculative(temperature, k, rounds_per_call):
  """The streamed chunks, concatenated per sequence, are generate_speculative's tokens (greedy and sampled, one
  or several rounds per call, a stop token and ragged prompts), and the stats match its record."""
  model = _drafting_model(0.3)
  kw = dict(max_new_tokens=30, num_draft_tokens=k, temperature=temperature, top_k=5, seed=4)
  free = generate_speculative(model, PROMPTS, eos_token_ids=(), **kw)
  stop = int(free.tokens[1, 11])  # row 1 stops early; the others may too
  ref = generate_speculative(model, PROMPTS, eos_token_ids=(stop,), **kw)
  assert ref.lengths[1] <= 12 and ref.lengths.max() == 30
  stats: dict = {}
  chunks = list(generate_speculative_stream(model, PROMPTS, eos_token_ids=(stop,), rounds_per_call=rounds_per_call,
                                            stats=stats, **kw))
  assert all(len(c) == 3 for c in chunks) and all(len(t) == 1 for t in chunks[0])
  for b in range(3):
    got = np.concatenate([c[b] for c in chunks])
    np.testing.assert_array_equal(got, ref.tokens[b, : ref.lengths[b]])
  np.testing.assert_array_equal(stats["rounds"], ref.rounds)
  np.testing.assert_array_equal(stats["accepted"], ref.accepted)
  # Each call runs rounds_per_call rounds of <= k + 1 tokens per sequence.
  assert max(len(c[b]) for c in chunks[1:] for b in range(3)) <= rounds_per_call * (k + 1)
  assert len(chunks) - 1 >= -(-int(ref.rounds.max()) // rounds_per_call)
  with pytest.raises(ValueError, match="rounds_per_call"):
    next(generate_speculative_stream(model, PROMPTS, max_new_tokens=4, rounds_per_call=0))


@pytest.mark.slow
def test_multimodal_speculative_decoding():
  """With image embeddings: greedy tokens equal generate's (prompt_embeds), the stream's too, and every round's
  d_1 is the MTP's over the sequence's embeddings shifted by one (image features where the next token is an
  image placeholder, not the placeholder's token embedding). The MTP layer's attention is amplified so that
  what it reads at the image positions decides its drafts."""
  model = m3jax.M3ForCausalLM(m3jax.tiny(vision=True, mtp=True), dtype=jnp.float32, rngs=nnx.Rngs(5),
                              with_vision=True, with_mtp=True, kernels="reference")
  _scale(model.mtp[0].layer.attn.o_proj, 8.0)
  image = model.config.image_token_id
  ids = np.asarray([[7, 9, image, image, 8, 30, 31, 32, 33, 34, 35]], np.int32)
  px = np.random.default_rng(0).normal(size=(8, 1176)).astype(np.float32)
  embeds = model.embed_multimodal(ids, pixel_values=px, image_grid_thw=[[1, 2, 4]])
  ref = m3jax.generate(model, ids, max_new_tokens=12, eos_token_ids=(), prompt_embeds=embeds)
  out = generate_speculative(model, ids, max_new_tokens=12, num_draft_tokens=2, eos_token_ids=(), prompt_embeds=embeds)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  streamed = list(generate_speculative_stream(model, ids, max_new_tokens=12, num_draft_tokens=2, eos_token_ids=(),
                                              prompt_embeds=embeds))
  np.testing.assert_array_equal(np.concatenate([c[0] for c in streamed]), ref.tokens[0])
  # Every round's d_1 from a cache-free MTP pass over the final sequence up to that round's position.
  seq = np.concatenate([ids[0], ref.tokens[0]])
  seq_embeds = jnp.concatenate([embeds[0], model.embed_tokens(jnp.asarray(ref.tokens))[0]], axis=0)
  # Compiled as programs (jit), not op by op (eager): fewer compiles.
  hidden = jax.jit(lambda ids, embeds: model.forward(ids, inputs_embeds=embeds).hidden)(
      jnp.asarray(seq[None]), seq_embeds[None])[0]
  # One causal pass over the whole sequence: its position p - 1 is the pass over the first p positions.
  n = len(seq) - 1
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  args = (jnp.asarray(seq[None, 1:]), hidden[None, :n])
  mtp_logits = jax.jit(lambda ids, hid, embeds: model.mtp_forward(ids, hid, positions=pos, next_embeds=embeds).logits)
  with_images = np.asarray(mtp_logits(*args, seq_embeds[None, 1:])[0])
  tokens_only = np.asarray(mtp_logits(*args, None)[0])
  p, mismatched_by_tokens = ids.shape[1], 0
  for r in range(out.drafts.shape[1]):
    assert out.drafts[0, r, 0] == with_images[p - 1].argmax(), r
    mismatched_by_tokens += int(tokens_only[p - 1].argmax() != out.drafts[0, r, 0])
    p += int(out.accepted_drafts[0, r]) + 1
  assert mismatched_by_tokens > 0  # reading token embeddings at the image positions would draft otherwise
  with pytest.raises(ValueError, match="next_embeds has shape"):
    model.mtp_forward(*args, positions=pos, next_embeds=args[1][:, 1:])
