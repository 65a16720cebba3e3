"""Multi-turn conversations that keep their caches: every reply equals generate() on the whole conversation, while
only the ids past the cached prefix are prefilled (new turns, rewritten history, cache-end padding, chunks, stops)."""

import jax
import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.conversation import Conversation, common_prefix_length
from m3jax.generate import generate


@pytest.fixture(scope="module")
def model():
  # Index blocks of 16 tokens, top-4: conversations past 64 tokens select blocks, so reused caches are read sparsely.
  return m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def ids():
  return np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]


def _reply(conv, prompt, n):
  chunks = list(conv.reply(prompt, max_new_tokens=n))
  assert all(c.dtype == np.int32 and c.ndim == 1 and c.size for c in chunks)
  return np.concatenate(chunks).tolist()


def _alone(model, prompt, n, **kw):
  out = generate(model, [prompt], max_new_tokens=n, **kw)
  return out.tokens[0, : out.lengths[0]].tolist()


@pytest.mark.quick
def test_common_prefix_length():
  assert common_prefix_length([], [1, 2]) == 0
  assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
  assert common_prefix_length([1, 2], [1, 2, 3]) == 2
  assert common_prefix_length([1, 2, 3], [1, 2]) == 2


@pytest.mark.parametrize("steps_per_call", [1, 4])
@pytest.mark.slow
def test_turns_equal_generate_and_prefill_only_what_is_new(model, ids, steps_per_call):
  conv = Conversation(model, max_length=512, eos_token_ids=(), steps_per_call=steps_per_call)
  prompt = ids[0, :40].tolist()
  reply = _reply(conv, prompt, 18)
  assert reply == _alone(model, prompt, 18, eos_token_ids=())
  assert (conv.last_turn.reused, conv.last_turn.prefilled, conv.last_turn.generated) == (0, 40, 18)
  assert conv.history == prompt + reply

  # Turn 2: the conversation so far plus 37 new ids; past 64 tokens, so the sparse layers select blocks.
  prompt2 = prompt + reply + ids[1, :37].tolist()
  reply2 = _reply(conv, prompt2, 20)
  assert reply2 == _alone(model, prompt2, 20, eos_token_ids=())
  assert (conv.last_turn.reused, conv.last_turn.prefilled) == (58, 37)
  assert conv.history == prompt2 + reply2

  # Turn 3 rewrites history inside reply 2 (a template dropping part of a reply): prefill from the first change.
  prompt3 = prompt2 + reply2[:5] + ids[0, 100:130].tolist()
  reply3 = _reply(conv, prompt3, 16)
  assert reply3 == _alone(model, prompt3, 16, eos_token_ids=())
  assert (conv.last_turn.reused, conv.last_turn.prefilled) == (len(prompt2) + 5, 30)

  # The same conversation again: everything is cached but the last id, whose logits give the first new token.
  again = _reply(conv, prompt3, 16)
  assert again == reply3
  assert (conv.last_turn.reused, conv.last_turn.prefilled) == (len(prompt3) - 1, 1)


def test_padding_past_the_end_of_the_caches_and_chunks(model, ids):
  # 100 cached ids + 27 new ones pad to 32 -> positions 100..131 in 128 slots: padding is clipped to the last
  # slot, never written over the prompt; chunks of 16 prefill the same.
  prompt = ids[0, :100].tolist()
  for chunk in (None, 16):
    conv = Conversation(model, max_length=128, eos_token_ids=(), prefill_chunk=chunk)
    first = _reply(conv, prompt[:60], 1)
    longer = prompt[:60] + first + ids[1, :27].tolist() + prompt[60:72]
    assert len(longer) == 100
    assert conv._slots == 128
    got = _reply(conv, longer, 28)
    assert got == _alone(model, longer, 28, eos_token_ids=(), max_length=128)
    assert (conv.last_turn.reused, conv.last_turn.prefilled, len(conv.history)) == (61, 39, 128)


def test_a_stop_token_ends_the_reply_and_the_next_turn_continues(model, ids):
  prompt = ids[0, :50].tolist()
  free = _alone(model, prompt, 12, eos_token_ids=())
  stop = free[6]
  expected = free[: free.index(stop) + 1]
  conv = Conversation(model, max_length=256, eos_token_ids=(stop,), steps_per_call=4)
  assert _reply(conv, prompt, 12) == expected
  assert conv.history == prompt + expected and conv.last_turn.generated == len(expected)
  # Tokens decoded past the stop in the same call sit in slots past the history; the next turn overwrites them.
  prompt2 = conv.history + ids[1, :20].tolist()
  assert _reply(conv, prompt2, 10) == _alone(model, prompt2, 10, eos_token_ids=(stop,))
  assert conv.last_turn.reused == len(prompt) + len(expected)


@pytest.mark.quick
def test_sampled_conversations_are_reproducible(model, ids):
  runs = []
  for _ in range(2):
    conv = Conversation(model, max_length=256, temperature=0.8, top_p=0.95, seed=3, eos_token_ids=())
    a = _reply(conv, ids[0, :30].tolist(), 8)
    b = _reply(conv, ids[0, :30].tolist() + a + ids[1, :10].tolist(), 8)
    runs.append((a, b))
  assert runs[0] == runs[1]
  conv = Conversation(model, max_length=256, temperature=0.8, top_p=0.95, seed=4, eos_token_ids=())
  assert (_reply(conv, ids[0, :30].tolist(), 8), ) != runs[0][:1]


@pytest.mark.quick
def test_bad_requests_fail_before_compute(model, ids):
  with pytest.raises(ValueError, match="max_length must be >= 2"):
    Conversation(model, max_length=1)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    Conversation(model, max_length=10**6)
  with pytest.raises(ValueError, match="prefill_chunk"):
    Conversation(model, max_length=64, prefill_chunk=24)
  conv = Conversation(model, max_length=64, eos_token_ids=())
  with pytest.raises(ValueError, match=r"\(60 tokens\) \+ max_new_tokens \(5\) exceeds max_length \(64"):
    conv.reply(ids[0, :60].tolist(), max_new_tokens=5)  # raises at the call, not at the first token
  with pytest.raises(ValueError, match="at least one prompt token"):
    next(conv.reply([], max_new_tokens=5))
  with pytest.raises(ValueError, match="outside"):
    next(conv.reply([model.config.text.vocab_size], max_new_tokens=5))
  with pytest.raises(ValueError, match="prompt_ids: token ids must be integers, got 3.0"):
    conv.reply([1, 3.0], max_new_tokens=5)
  with pytest.raises(ValueError, match="eos_token_ids outside"):
    Conversation(model, max_length=64, eos_token_ids=[-1])
  assert conv.history == []


def test_an_abandoned_or_interrupted_reply_leaves_a_usable_conversation(model, ids):
  conv = Conversation(model, max_length=256, eos_token_ids=(), steps_per_call=2)
  prompt = ids[0, :40].tolist()
  stream = conv.reply(prompt, max_new_tokens=12)
  first = next(stream).tolist()
  stream.close()  # the caller stops reading after 2 tokens: the history holds what it read
  assert conv.history == prompt + first and len(first) == 2
  follow = conv.history + ids[1, :10].tolist()
  assert _reply(conv, follow, 6) == _alone(model, follow, 6, eos_token_ids=())
  assert conv.last_turn.reused == len(prompt) + 2
  # A Ctrl-C while a call held the donated caches leaves them deleted: the next turn starts them afresh.
  for leaf in jax.tree.leaves(conv.caches):
    leaf.delete()
  assert _reply(conv, follow, 6) == _alone(model, follow, 6, eos_token_ids=())
  assert conv.last_turn.reused == 0


def test_multimodal_turns_reuse_the_cache_only_where_the_images_match():
  ref = np.load(FIXTURES / "vl_tiny" / "reference.npz")
  vl = m3jax.load(FIXTURES / "vl_tiny" / "checkpoint", kernels="reference")
  pixels = {k: ref[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  prompt = ref["input_ids"][0].tolist()
  conv = Conversation(vl, max_length=512, eos_token_ids=())
  embeds = vl.embed_multimodal(ref["input_ids"], **pixels)
  reply = _reply_mm(conv, prompt, embeds, 6)
  assert reply == _alone(vl, prompt, 6, eos_token_ids=(), prompt_embeds=embeds)

  prompt2 = prompt + reply + [7, 8, 9, 10, 11]
  embeds2 = vl.embed_multimodal(np.asarray([prompt2]), **pixels)
  reply2 = _reply_mm(conv, prompt2, embeds2, 6)
  assert reply2 == _alone(vl, prompt2, 6, eos_token_ids=(), prompt_embeds=embeds2)
  assert conv.last_turn.reused == len(prompt) + 6

  # The same ids with other images: the cache serves only the positions before the first image placeholder.
  other = dict(pixels, pixel_values=pixels["pixel_values"][::-1].copy())
  embeds3 = vl.embed_multimodal(np.asarray([prompt2]), **other)
  reply3 = _reply_mm(conv, prompt2, embeds3, 6)
  assert reply3 == _alone(vl, prompt2, 6, eos_token_ids=(), prompt_embeds=embeds3)
  assert conv.last_turn.reused == prompt2.index(vl.config.image_token_id)
  # (This tiny model's tokens hardly depend on the images; its cached keys do.) The caches hold the new images'.
  fresh = m3jax.prefill(vl, [prompt2], max_new_tokens=1, prompt_embeds=embeds3).caches
  n = len(prompt2)
  for a, b in zip(fresh, conv.caches):
    np.testing.assert_allclose(np.asarray(b.k[0, :n]), np.asarray(a.k[0, :n]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(b.v[0, :n]), np.asarray(a.v[0, :n]), atol=1e-5)
  with pytest.raises(ValueError, match="prompt_embeds has shape"):
    next(conv.reply(prompt2, max_new_tokens=2, prompt_embeds=embeds3[:, 1:]))


def _reply_mm(conv, prompt, embeds, n):
  return np.concatenate(list(conv.reply(prompt, max_new_tokens=n, prompt_embeds=embeds))).tolist()
