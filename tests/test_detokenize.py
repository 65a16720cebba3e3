"""Streaming detokenisation: deltas add up to the decoded text, never show a partial character, and stop strings
cut the text before their first occurrence, found at the exact token."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from m3jax.demo import train_demo_tokenizer
from m3jax.detokenize import IncrementalText

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier

TEXT = "naïve 数据 🙂 ok, the block holds 128 keys; ünïcödé ✓✓ done"


@pytest.fixture(scope="module")
def tok():
  return train_demo_tokenizer()


def _chunks(ids, rng):
  out, i = [], 0
  while i < len(ids):
    n = rng.randint(1, 5)
    out.append(ids[i:i + n])
    i += n
  return out


def test_multibyte_characters_are_released_once_whole(tok):
  ids = tok.encode(TEXT, add_special_tokens=False).ids
  assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the tokenizer does split characters
  text = IncrementalText(tok)
  deltas = [text.add([t]) for t in ids]
  assert "".join(deltas) + text.finish() == TEXT == text.text
  assert not any("\ufffd" in d for d in deltas)
  # Negative control: printing decode(ids)[len(printed):] per token loses characters.
  printed = ""
  for i in range(1, len(ids) + 1):
    printed += tok.decode(ids[:i])[len(printed):]
  assert printed != TEXT


@pytest.mark.parametrize("seed", range(5))
def test_windowed_decode_equals_decoding_everything(tok, seed):
  rng = random.Random(seed)
  vocab = tok.get_vocab_size()
  ids = [rng.randrange(vocab) for _ in range(300)]  # random ids: special tokens, stray UTF-8 continuation bytes
  text = IncrementalText(tok)
  out = "".join(text.add(c) for c in _chunks(ids, rng)) + text.finish()
  assert out == tok.decode(ids, skip_special_tokens=False)


def test_a_decoder_that_strips_the_first_space_still_lines_up():
  words = ["▁Hello", "▁world", "▁of", "▁sparse", "▁blocks", "!"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!"))
  tok.decoder = decoders.Metaspace()
  ids = [0, 1, 2, 3, 4, 1, 2, 3, 4, 5]
  text = IncrementalText(tok)
  assert "".join(text.add([t]) for t in ids) + text.finish() == tok.decode(ids) == (
      "Hello world of sparse blocks world of sparse blocks!")


@pytest.mark.parametrize("stop", [["🙂"], ["128 k", "ok,"], ["ünï", "never there"], ["e"], [" done"]])
def test_stop_strings_cut_before_the_first_one_at_the_exact_token(tok, stop):
  ids = tok.encode(TEXT, add_special_tokens=False).ids
  first = min(TEXT.find(s) for s in stop if s in TEXT)
  for seed in range(3):
    text = IncrementalText(tok, stop)
    deltas = [text.add(c) for c in _chunks(ids, random.Random(seed))]
    assert text.stopped
    out = "".join(deltas) + text.finish()
    assert out == TEXT[:first] == text.text
    # stop_index is the token that completed the (first) stop string: one fewer and no stop string is there yet.
    assert any(s in tok.decode(ids[:text.stop_index]) for s in stop)
    assert not any(s in tok.decode(ids[:text.stop_index - 1]) for s in stop)
    assert text.add(ids) == ""  # after the stop, nothing more


def test_a_possible_stop_string_start_is_held_back_then_released(tok):
  ids = tok.encode("the block holds", add_special_tokens=False).ids
  text = IncrementalText(tok, ["blocked"])
  deltas = [text.add([t]) for t in ids]
  assert "".join(deltas) == "the block holds" and not text.stopped
  # While "block" might still become "blocked", none of it was released.
  released = [len("".join(deltas[:i + 1])) for i in range(len(ids))]
  decoded = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
  for n, d in zip(released, decoded):
    if d.endswith(("b", "bl", "blo", "bloc", "block")):
      assert n <= len("the ")
  assert text.finish() == ""


def test_bad_stop_strings_are_refused(tok):
  with pytest.raises(ValueError, match="non-empty strings"):
    IncrementalText(tok, ["ok", ""])
