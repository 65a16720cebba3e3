"""The paged engine on image / video prompts (``submit(prompt_embeds=...)``): greedy tokens equal generate() with the
same embeddings, also prefilled in chunks beside a text request or recomputed after a preemption; the prefix cache
serves an image's pages to requests and conversation turns with the same image only (their keys hold the
placeholder rows' fingerprints). The tiny vision checkpoint's
index block (16 tokens) is the page size; its 194-token prompt holds images from position 17 on."""

import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.engine import Engine
from m3jax.generate import generate

_POOL = dict(max_seqs=2, max_tokens_in_cache=40 * 16, eos_token_ids=(), steps_per_call=2, logprobs=True)


@pytest.fixture(scope="module")
def vl():
  return m3jax.load(FIXTURES / "vl_tiny" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def inputs(vl):
  """(the prompt's ids, its pixel inputs, the same pixels with the images reversed)."""
  ref = np.load(FIXTURES / "vl_tiny" / "reference.npz")
  pixels = {k: ref[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  other = dict(pixels, pixel_values=pixels["pixel_values"][::-1].copy())
  return ref["input_ids"][0].tolist(), pixels, other


def _alone(model, prompt, n, embeds=None):
  out = generate(model, [prompt], max_new_tokens=n, eos_token_ids=(), prompt_embeds=embeds)
  return out.tokens[0, : out.lengths[0]].tolist()


def _run(engine):
  done = {c.request_id: c for c in engine.run()}
  assert all(c.finish_reason == "length" for c in done.values()), done
  assert engine.stats().pages_in_use == 0
  return done


def test_image_prompts_equal_generate_and_reuse_pages_only_where_the_images_match(vl, inputs):
  prompt, pixels, other = inputs
  first_image = prompt.index(vl.config.image_token_id)
  assert first_image == 17  # page 0 is text, page 1 on hold images
  embeds = vl.embed_multimodal(np.asarray([prompt]), **pixels)
  text = prompt[:16] + [7, 8, 9, 10, 11, 12, 13]
  # Chunks of 64 tokens: the first prefill call holds the text request (23 tokens) and the image prompt's first 41
  # (a mixed call: embeddings for one row, token embeddings for the other), then the image prompt goes on alone.
  engine = Engine(vl, prefill_chunk=64, **_POOL)
  engine.submit(text, max_new_tokens=5, request_id="text")
  engine.submit(prompt, max_new_tokens=6, request_id="image", prompt_embeds=embeds)
  done = _run(engine)
  assert done["image"].tokens.tolist() == _alone(vl, prompt, 6, embeds)
  assert done["text"].tokens.tolist() == _alone(vl, text, 5)
  assert engine.prefills == 4 and done["image"].cached_tokens == 0

  # The same images behind a longer prompt: its 12 full prompt pages are read from the cache.
  longer = prompt + [7, 8, 9]
  embeds2 = vl.embed_multimodal(np.asarray([longer]), **pixels)
  hits = engine.stats().prefix_hit_tokens
  engine.submit(longer, max_new_tokens=6, request_id="same images", prompt_embeds=embeds2)
  again = _run(engine)["same images"]
  assert again.cached_tokens == 12 * 16 and engine.stats().prefix_hit_tokens - hits == 12 * 16
  assert again.tokens.tolist() == _alone(vl, longer, 6, embeds2)

  # The same ids with other images: only the text page before the first image is read from the cache.
  embeds3 = vl.embed_multimodal(np.asarray([prompt]), **other)
  engine.submit(prompt, max_new_tokens=6, request_id="other images", prompt_embeds=embeds3)
  swapped = _run(engine)["other images"]
  assert swapped.cached_tokens == 16
  assert swapped.tokens.tolist() == _alone(vl, prompt, 6, embeds3)
  # (This tiny model's tokens hardly depend on the images; its log-probabilities do.) They are those of an
  # engine that never saw the first images, not the first images'.
  fresh = Engine(vl, prefix_caching=False, **_POOL)
  fresh.submit(prompt, max_new_tokens=6, request_id="fresh", prompt_embeds=embeds3)
  np.testing.assert_allclose(swapped.logprobs, _run(fresh)["fresh"].logprobs, atol=1e-5)
  assert np.abs(swapped.logprobs - done["image"].logprobs).max() > 1e-3

  # A conversation on the engine: turn 1 (the first images) reads their cached pages; turn 2 re-renders turn 1, and
  # its reply fills the 13th page, read from the cache too.
  conv = engine.conversation()
  reply = np.concatenate(list(conv.reply(prompt, max_new_tokens=14, prompt_embeds=embeds))).tolist()
  assert reply == _alone(vl, prompt, 14, embeds) and conv.last_turn.reused == 12 * 16
  turn2 = prompt + reply + [7, 8, 9, 10, 11]
  embeds4 = vl.embed_multimodal(np.asarray([turn2]), **pixels)
  reply2 = np.concatenate(list(conv.reply(turn2, max_new_tokens=6, prompt_embeds=embeds4))).tolist()
  assert reply2 == _alone(vl, turn2, 6, embeds4) and conv.last_turn.reused == 13 * 16


def test_a_preempted_image_request_is_recomputed_with_its_embeddings(vl, inputs):
  prompt, pixels, _ = inputs
  embeds = vl.embed_multimodal(np.asarray([prompt]), **pixels)
  # 16 pages. The text request (20 + 30 tokens) is older; the image request (194 + 20) needs its 14th page after
  # 13 tokens, when the text request holds 3: it is the newest, so it is preempted and waits with its tokens, to
  # be recomputed (its prompt from its embeddings, then its tokens) once the text request is done.
  engine = Engine(vl, max_seqs=2, max_tokens_in_cache=16 * 16, eos_token_ids=(), steps_per_call=2,
                  prefix_caching=False)
  text = prompt[:10] + [7] * 10
  engine.submit(text, max_new_tokens=30, request_id="text")
  engine.submit(prompt, max_new_tokens=20, request_id="image", prompt_embeds=embeds)
  done = _run(engine)
  assert engine.preemptions >= 1
  assert done["image"].tokens.tolist() == _alone(vl, prompt, 20, embeds)
  assert done["text"].tokens.tolist() == _alone(vl, text, 30)


@pytest.mark.quick
def test_image_prompts_need_their_embeddings(vl, inputs):
  prompt, _, _ = inputs
  engine = Engine(vl, max_seqs=1, max_length=256)
  with pytest.raises(ValueError, match=r"request 'x': the prompt ids hold image / video placeholder tokens"):
    engine.submit(prompt, max_new_tokens=2, request_id="x")
  with pytest.raises(ValueError, match=r"request 'y': prompt_embeds has shape \(1, 193, 64\); expected "
                                       r"\[1, 194, 64\]"):
    engine.submit(prompt, max_new_tokens=2, request_id="y", prompt_embeds=np.zeros((1, 193, 64), np.float32))
  assert engine.stats().waiting == 0
