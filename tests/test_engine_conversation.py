"""Conversations on the paged engine (``Engine.conversation``): each turn reads the full pages of the earlier turns
(prompts and replies) and of other conversations sharing them from the prefix cache, and replies as the contiguous
Conversation does (greedy). The tiny checkpoint's index block (16 tokens) is the page size."""

import numpy as np
import pytest

import m3jax
from conftest import FIXTURES
from m3jax.conversation import Conversation
from m3jax.engine import Engine
from m3jax.engine_conversation import EngineConversation


@pytest.fixture(scope="module")
def model():
  return m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")


@pytest.fixture(scope="module")
def ids():
  return np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"]


def _engine(model):
  return Engine(model, max_seqs=2, max_tokens_in_cache=20 * 16, eos_token_ids=(), steps_per_call=2)


def _reply(conv, prompt, n):
  chunks = list(conv.reply(prompt, max_new_tokens=n))
  assert all(c.dtype == np.int32 and c.ndim == 1 and c.size for c in chunks)
  return np.concatenate(chunks).tolist()


def _turn(conv):
  return conv.last_turn.reused, conv.last_turn.prefilled, conv.last_turn.generated


def test_turns_read_the_earlier_turns_full_pages_and_reply_as_the_contiguous_conversation(model, ids):
  paged = _engine(model).conversation()
  contiguous = Conversation(model, max_length=256, eos_token_ids=(), steps_per_call=2)
  prompt = ids[0, :40].tolist()
  reply = _reply(paged, prompt, 18)
  assert reply == _reply(contiguous, prompt, 18)
  assert _turn(paged) == (0, 40, 18) and paged.history == prompt + reply

  # Turn 2: turn 1's 58 tokens (prompt + reply) fill 3 pages, read from the cache; the rest is prefilled.
  prompt2 = prompt + reply + ids[1, :37].tolist()
  reply2 = _reply(paged, prompt2, 20)
  assert reply2 == _reply(contiguous, prompt2, 20)
  assert _turn(paged) == (48, 47, 20) and paged.history == prompt2 + reply2

  # Turn 3 rewrites reply 2 after its 5th token (position 100): the pages before the one holding it are reused.
  prompt3 = prompt2 + reply2[:5] + ids[0, 100:130].tolist()
  assert _reply(paged, prompt3, 8) == _reply(contiguous, prompt3, 8)
  assert _turn(paged) == (96, len(prompt3) - 96, 8)
  assert paged.engine.stats().pages_in_use == 0


def test_conversations_sharing_a_system_prompt_share_its_pages(model, ids):
  engine = _engine(model)
  system = ids[1, 40:80].tolist()  # 2 full pages and 8 tokens
  first, second = engine.conversation(), EngineConversation(engine)
  a = _reply(first, system + ids[0, :10].tolist(), 6)
  assert _turn(first) == (0, 50, 6)
  b = _reply(second, system + ids[0, 50:62].tolist(), 6)
  assert _turn(second) == (32, 20, 6)
  contiguous = Conversation(model, max_length=256, eos_token_ids=(), steps_per_call=2)
  assert a == _reply(contiguous, system + ids[0, :10].tolist(), 6)
  contiguous.reset()
  assert b == _reply(contiguous, system + ids[0, 50:62].tolist(), 6)
  # Sampled conversations are reproducible for a seed.
  runs = [_reply(engine.conversation(temperature=0.8, seed=3), system, 8) for _ in range(2)]
  assert runs[0] == runs[1]


def test_an_abandoned_reply_leaves_the_engine_and_the_conversation_usable(model, ids):
  engine = _engine(model)
  conv = engine.conversation()
  prompt = ids[0, :40].tolist()
  stream = conv.reply(prompt, max_new_tokens=12)
  first = next(stream).tolist()
  stream.close()  # the caller stops reading: the history holds what it read, the engine is emptied
  assert conv.history == prompt + first and engine.stats().running == 0
  conv.reply(prompt, max_new_tokens=4)  # never read: the next reply drops it
  follow = prompt + first + ids[1, :10].tolist()
  want = _reply(Conversation(model, max_length=128, eos_token_ids=(), steps_per_call=2), follow, 6)
  assert _reply(conv, follow, 6) == want
  assert conv.last_turn.reused == 32  # the prompt's 2 full pages


@pytest.mark.quick
def test_bad_turns_and_a_busy_engine_are_refused_before_anything_runs(model, ids):
  engine = _engine(model)
  conv = engine.conversation()
  prompt = ids[0, :40].tolist()
  with pytest.raises(ValueError, match=r"request conversation turn 1: prompt \(40 tokens\) \+ max_new_tokens"):
    conv.reply(prompt, max_new_tokens=10**4)
  with pytest.raises(ValueError, match="prompt_ids: token ids must be integers, got 3.0"):
    conv.reply([1, 3.0], max_new_tokens=5)
  with pytest.raises(ValueError, match="seed must be an integer"):
    engine.conversation(seed=-1)
  assert conv.history == [] and engine.stats().waiting == 0
  engine.submit(prompt, max_new_tokens=2, request_id="other")
  with pytest.raises(RuntimeError, match=r"the engine is serving other requests \(0 running, 1 waiting\)"):
    conv.reply(prompt, max_new_tokens=2)
