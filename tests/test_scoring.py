"""Scoring: per-token log-probabilities against HF's logits, ragged batches, chunked forwards, continuation
log-likelihoods and perplexity."""

import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.generate import generate
from m3jax.scoring import score_continuations, token_logprobs


@pytest.fixture(scope="module")
def model():
  return m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def ref():
  return np.load(FIXTURES / "flat_b16" / "reference.npz")


def _hf_logprobs(ref, b, n):
  """log p(token t | tokens < t) from HF's fp32 logits, for t = 1 .. n - 1."""
  logits = ref["logits"][b, : n - 1].astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  ids = ref["input_ids"][b, 1:n]
  return logits[np.arange(n - 1), ids] - logz, ids == logits.argmax(-1)


@pytest.mark.parametrize("name", ["legacy_b128", "flat_local2_b128", "flat_b16"])
def test_token_logprobs_and_perplexity_equal_hf(name):
  ref = np.load(FIXTURES / name / "reference.npz")
  b, n = ref["input_ids"].shape
  out = token_logprobs(m3jax.load(FIXTURES / name / "checkpoint", kernels="reference"), ref["input_ids"])
  hf = [_hf_logprobs(ref, row, n)[0] for row in range(b)]
  np.testing.assert_allclose(out.logprobs[:, 1:n], np.stack(hf), atol=2e-5)  # seen: <= 3.6e-6
  assert out.perplexity() == pytest.approx(np.exp(-np.concatenate(hf).mean()), rel=1e-5)


def test_ragged_rows_are_scored_independently(model, ref):
  lengths = (150, 97)
  seqs = [ref["input_ids"][b, :n].tolist() for b, n in enumerate(lengths)]
  out = token_logprobs(model, seqs)
  assert out.logprobs.shape == (2, 256) and out.logprobs.dtype == np.float32  # bucket of 150
  np.testing.assert_array_equal(out.lengths, lengths)
  for b, n in enumerate(lengths):
    want, want_greedy = _hf_logprobs(ref, b, n)
    np.testing.assert_allclose(out.logprobs[b, 1:n], want, atol=2e-5)
    assert out.logprobs[b, 0] == 0 and not out.greedy[b, 0]
    assert not out.logprobs[b, n:].any() and not out.greedy[b, n:].any()
    margin = np.sort(ref["logits"][b, : n - 1], -1)
    clear = margin[:, -1] - margin[:, -2] > 1e-3  # the argmax is not a near-tie
    np.testing.assert_array_equal(out.greedy[b, 1:n][clear], want_greedy[clear])
    alone = token_logprobs(model, [seqs[b]])
    np.testing.assert_allclose(alone.logprobs[0, :n], out.logprobs[b, :n], atol=1e-5)
  total = sum(n - 1 for n in lengths)
  assert out.scored_tokens == total
  want_ppl = np.exp(-(np.sum(_hf_logprobs(ref, 0, 150)[0]) + np.sum(_hf_logprobs(ref, 1, 97)[0])) / total)
  assert out.perplexity() == pytest.approx(want_ppl, rel=1e-4)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_scoring_equals_one_shot(model, ref, chunk):
  seqs = [ref["input_ids"][0, :150].tolist(), ref["input_ids"][1, :40].tolist()]
  whole = token_logprobs(model, seqs)
  chunked = token_logprobs(model, seqs, prefill_chunk=chunk)
  np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-4)
  assert (chunked.greedy == whole.greedy).mean() > 0.99


@pytest.mark.quick
def test_continuation_scores(model, ref):
  prompt = ref["input_ids"][0, :60].tolist()
  greedy = generate(model, [prompt], max_new_tokens=6, eos_token_ids=()).tokens[0].tolist()
  other = ref["input_ids"][1, :6].tolist()
  out = score_continuations(model, [prompt, prompt, [5]], [greedy, other, other])
  np.testing.assert_array_equal(out.num_tokens, [6, 6, 6])
  assert out.greedy.tolist() == [True, False, False]  # generate's tokens are greedy; the fixture's row 1 is not
  full = token_logprobs(model, [prompt + greedy, prompt + other, [5] + other])
  want = [full.logprobs[0, 60:66].sum(), full.logprobs[1, 60:66].sum(), full.logprobs[2, 1:7].sum()]
  np.testing.assert_allclose(out.logprob, want, rtol=1e-5)
  assert out.logprob[0] > out.logprob[1]  # the greedy continuation is the likelier one here


@pytest.mark.quick
def test_bad_inputs_fail_clearly(model):
  with pytest.raises(ValueError, match="outside"):
    token_logprobs(model, [[1, 2, 256]])
  with pytest.raises(ValueError, match="at least one token"):
    token_logprobs(model, [[1], []])
  with pytest.raises(ValueError, match="prefill_chunk"):
    token_logprobs(model, [[1, 2]], prefill_chunk=12)
  with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
    score_continuations(model, [[1], [2]], [[3]])
  with pytest.raises(ValueError, match="pair 0"):
    score_continuations(model, [[1]], [[]])
  with pytest.raises(ValueError, match="no token to score"):
    token_logprobs(model, [[7]]).perplexity()


def test_multimodal_logprobs_follow_the_multimodal_forward():
  ref = np.load(FIXTURES / "vl_tiny" / "reference.npz")
  vl = m3jax.load(FIXTURES / "vl_tiny" / "checkpoint", kernels="reference")
  pixels = {k: ref[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  ids = ref["input_ids"]
  n = ids.shape[1]
  embeds = vl.embed_multimodal(ids, **pixels)
  logits = np.asarray(vl(ids, **pixels), np.float64)[0, :-1]  # the full multimodal forward (HF-checked elsewhere)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  want = logits[np.arange(n - 1), ids[0, 1:]] - logz
  for chunk in (None, 64):
    got = token_logprobs(vl, ids, prompt_embeds=embeds, prefill_chunk=chunk).logprobs[0, 1:n]
    np.testing.assert_allclose(got, want, atol=2e-5)
  text_only = token_logprobs(vl, ids).logprobs[0, 1:n]
  assert np.abs(text_only - want).max() > 1e-3  # the images reach the scores


def test_top_k_alternatives_equal_hfs_and_hold_the_greedy_token_exactly(model, ref):
  """token_logprobs(top_k=k) (what m3jax serve's echo lists): at each position the k most likely next tokens of
  HF's logits, most likely first, and a greedy token's own log-probability equals its first entry bit for bit
  (lm-eval's is_greedy compares them with ==); chunked (the prefill_chunk scan) too."""
  lengths = (150, 97)
  seqs = [ref["input_ids"][b, :n].tolist() for b, n in enumerate(lengths)]
  for chunk in (None, 64):
    out = token_logprobs(model, seqs, top_k=3, prefill_chunk=chunk)
    assert out.top_ids.shape == out.top_logprobs.shape == (2, 256, 3) and out.top_ids.dtype == np.int32
    for b, n in enumerate(lengths):
      logits = ref["logits"][b, : n - 1].astype(np.float64)
      logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      top = np.sort(logits, -1)[:, ::-1][:, :3] - logz[:, None]
      np.testing.assert_allclose(out.top_logprobs[b, 1:n], top, atol=2e-5)
      clear = top[:, 0] - top[:, 1] > 1e-3
      np.testing.assert_array_equal(out.top_ids[b, 1:n, 0][clear], logits.argmax(-1)[clear])
      greedy = out.greedy[b, 1:n]
      np.testing.assert_array_equal(out.logprobs[b, 1:n][greedy], out.top_logprobs[b, 1:n, 0][greedy])
      assert greedy.any() and not out.top_ids[b, 0].any() and not out.top_logprobs[b, n:].any()
  assert token_logprobs(model, seqs).top_ids is None
  with pytest.raises(ValueError, match="top_k must be an integer in"):
    token_logprobs(model, seqs, top_k=-1)
