"""m3jax.reply.Reply: one request's updates -> pieces of text, listed tokens, log-probabilities and the finish.

Updates are built by hand (no model): the engine's side is tested in test_engine / test_serving / test_cli."""

import random

import numpy as np
import pytest

from m3jax.demo import train_demo_tokenizer
from m3jax.detokenize import TokenStrings
from m3jax.engine import Completion, TopLogprobs, Update
from m3jax.reply import Reply

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier

TEXT = "naïve 数据 🙂 ok; the block holds 128 keys. ünïcödé ✓ done"
EOS = 7  # stands for the stop token


@pytest.fixture(scope="module")
def tok():
  return train_demo_tokenizer()


def _updates(ids, sizes, finish=None, stop_token=False, top_k=0):
  """Updates of ids in calls of the given sizes, each token's "log-probability" being -its position; the last
  carries a Completion (with the stop token appended when stop_token)."""
  ids = list(ids) + ([EOS] if stop_token else [])
  lps = -np.arange(len(ids), dtype=np.float32)
  out, i = [], 0
  for n in sizes:
    j = min(len(ids), i + n)
    last = j == len(ids)
    top = None
    if top_k:
      top = TopLogprobs(ids=np.tile(np.arange(top_k, dtype=np.int32), (j - i, 1)),
                        logprobs=np.tile(lps[i:j, None], (1, top_k)))
    out.append(Update(request_id=0, new_tokens=np.asarray(ids[i:j], np.int32), logprobs=lps[i:j],
                      top_logprobs=top,
                      completion=Completion(0, np.asarray(ids, np.int32), finish, lps) if last and finish else None))
    i = j
    if last:
      break
  return out


def _sizes(rng, n):
  return [rng.randint(1, 4) for _ in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_pieces_add_up_to_the_text_and_list_every_shown_token_once(tok, seed):
  ids = tok.encode(TEXT, add_special_tokens=False).ids
  rng = random.Random(seed)
  reply = Reply(tok, token_strings=TokenStrings(tok))
  pieces = [reply.add(u) for u in _updates(ids, _sizes(rng, len(ids)), finish="stop", stop_token=True)]
  assert "".join(p.text for p in pieces) == TEXT == reply.text
  assert [t for p in pieces for t in p.ids] == ids  # the stop token is not listed ...
  assert reply.tokens == ids + [EOS] and pieces[-1].generated == len(ids) + 1  # ... but it is counted and kept
  assert [x for p in pieces for x in p.logprobs] == [-float(i) for i in range(len(ids))]
  assert reply.logprobs[-1] == -len(ids)  # the stop token's log-probability is kept with it
  assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)
  assert pieces[-1].finish_reason == "stop" and not reply.cancel
  # Each listed token's offset is the index of the character its first byte belongs to (several tokens of one
  # multi-byte character share it): checked against TEXT's own UTF-8 encoding.
  strings = TokenStrings(tok)
  owner = [c for c, ch in enumerate(TEXT) for _ in ch.encode("utf-8")]  # byte -> its character's index
  starts = np.cumsum([0] + [len(strings.bytes(t)) for t in ids])[:-1]
  offsets = [o for p in pieces for o in p.offsets]
  assert offsets == [owner[b] for b in starts]
  assert any(len(ch.encode("utf-8")) >= 3 for ch in TEXT)  # the case two-byte characters would not exercise
  # A token is listed only once its text is out: no piece lists a token whose text a later piece shows.
  shown = 0
  for p in pieces:
    shown += len(p.text)
    assert all(o <= shown for o in p.offsets)


def test_a_stop_string_cuts_text_tokens_and_log_probabilities_and_asks_for_a_cancel(tok):
  ids = tok.encode(TEXT, add_special_tokens=False).ids
  reply = Reply(tok, stop=["holds"])
  pieces = []
  for u in _updates(ids, [3] * len(ids), finish="length"):
    pieces.append(reply.add(u))
    if reply.finish_reason is not None:
      break
  assert reply.text == TEXT[:TEXT.index("holds")] == "".join(p.text for p in pieces)
  assert pieces[-1].finish_reason == "stop" and reply.cancel  # the engine had not finished: cancel it
  n = len(reply.tokens)
  assert tok.decode(ids[:n]).find("holds") >= 0 > tok.decode(ids[:n - 1]).find("holds")  # cut at the exact token
  assert reply.tokens == ids[:n] and pieces[-1].generated == n
  assert reply.logprobs[:n] == [-float(i) for i in range(n)]
  # Listed (with log-probabilities) are the tokens that spell the text kept, not the stop string's own (#49).
  listed = [t for p in pieces for t in p.ids]
  assert listed == ids[:len(listed)] and len(listed) < n
  assert tok.decode(listed).startswith(reply.text) and not tok.decode(listed[:-1]).startswith(reply.text)
  assert [x for p in pieces for x in p.logprobs] == [-float(i) for i in range(len(listed))]
  with pytest.raises(ValueError, match="after its reply finished"):
    reply.add(_updates(ids, [1])[0])


def test_a_stop_string_in_the_engines_last_update_needs_no_cancel(tok):
  ids = tok.encode(TEXT, add_special_tokens=False).ids
  reply = Reply(tok, stop=["done"])
  for u in _updates(ids, [len(ids) + 1], finish="stop", stop_token=True):
    piece = reply.add(u)
  assert piece.finish_reason == "stop" and not reply.cancel and reply.text == TEXT[:TEXT.index("done")]
  assert EOS not in reply.tokens  # cut at the token that completed "done", before the stop token


def test_without_a_tokenizer_ids_only(tok):
  del tok
  ids = [5, 9, 11, 13]
  reply = Reply()
  pieces = [reply.add(u) for u in _updates(ids, [3, 3], finish="length", top_k=2)]
  assert [p.ids for p in pieces] == [[5, 9, 11], [13]] and [p.text for p in pieces] == ["", ""]
  assert reply.text is None and reply.tokens == ids and pieces[-1].finish_reason == "length"
  assert pieces[0].top[0] == [[0, 1]] * 3 and pieces[1].top[1] == [[-3.0, -3.0]]
  assert pieces[0].offsets is None
  with pytest.raises(ValueError, match="need a tokenizer"):
    Reply(stop=["x"])
