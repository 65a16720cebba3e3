"""One request's reply as the engine's updates arrive: the bookkeeping ``m3jax serve`` and ``m3jax batch`` share.

``Reply.add(update)`` takes each ``m3jax.engine.Update`` of one request and returns a ``Piece``: the text that is
now final (m3jax.detokenize: no partial character, no possible stop-string start), the tokens behind it with their
log-probabilities, and on the last piece the finish reason. A stop token is kept in ``tokens`` (and its
log-probability in ``logprobs``) but never shown; a stop string ends the text before it, cuts ``tokens`` after the
token that completed it, and sets ``cancel`` (the engine must be told to free the slot, since it has not finished
the request itself).
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Sequence

from m3jax.detokenize import IncrementalText, TokenStrings
from m3jax.engine import Update


@dataclasses.dataclass(frozen=True)
class Piece:
  """What one engine update adds to a reply: text (the newly final text), finish_reason (on the last piece),
  generated (tokens counted so far), and the tokens behind the text released so far that no earlier piece
  listed: ids, logprobs [n] and top (ids [n, k], logprobs [n, k]) when the engine computes them, and offsets
  (each listed token's first character's index in the reply's text) when the Reply has ``token_strings``;
  cached_tokens: the request's prompt tokens read from the engine's prefix cache (``Update.cached_tokens``)."""

  text: str
  finish_reason: str | None
  generated: int
  ids: list[int]
  logprobs: list[float] | None = None
  top: tuple[list[list[int]], list[list[float]]] | None = None
  offsets: list[int] | None = None
  cached_tokens: int = 0


class Reply:
  """Accumulates one request's updates.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``, or None for ids only (no text; then no stop strings either).
    stop: stop strings (the text ends before the first one).
    token_strings: the tokenizer's ``TokenStrings``, to give each listed token's character offset in the text.
    skip_special_tokens: leave special tokens (``<bos>``, image markers, ...) out of the text (they are still
      listed, each at the offset where it would have been, taking no characters).
    list_stop_token: list the stop token too, at the end of the text (OpenAI's echo layout, where every generated
      token has a log-probability); by default it is neither shown nor listed.

  Attributes (after each ``add``): tokens (every generated id, the stop token included, cut after the token that
  completed a stop string), logprobs (one per token, when the engine computes them), finish_reason ("stop" |
  "length" | ... once finished, else None), cancel (a stop string finished the reply before the engine did: the
  caller must ``Engine.cancel`` the request), text (the reply's text so far, None without a tokenizer).
  """

  def __init__(self, tokenizer=None, stop: Sequence[str] = (), token_strings: TokenStrings | None = None, *,
               skip_special_tokens: bool = False, list_stop_token: bool = False):
    if stop and tokenizer is None:
      raise ValueError(f"stop strings {list(stop)!r} need a tokenizer")
    self._tokenizer, self._skip, self._list_stop = tokenizer, skip_special_tokens, list_stop_token
    self._text = IncrementalText(tokenizer, stop, skip_special_tokens) if tokenizer is not None else None
    self._strings = token_strings
    self._shown: list[int] = []  # ids whose text the reply shows (without a tokenizer: every non-stop-token id)
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self._top_ids: list[list[int]] = []
    self._top_logprobs: list[list[float]] = []
    self.finish_reason: str | None = None
    self.cancel = False
    self._listed = 0  # shown ids already listed in a piece
    self._offsets = None if token_strings is None else TextOffsets(token_strings, skip_special_tokens)

  @property
  def text(self) -> str | None:
    return None if self._text is None else self._text.text

  def add(self, update: Update) -> Piece:
    """The next update of this request -> what it adds. Raises ValueError once the reply has finished."""
    if self.finish_reason is not None:
      raise ValueError(f"request {update.request_id!r}: an update after its reply finished "
                       f"({self.finish_reason})")
    new, done = update.new_tokens.tolist(), update.completion
    self.tokens.extend(new)
    if update.logprobs is not None:
      self.logprobs.extend(update.logprobs.tolist())
    if update.top_logprobs is not None:
      self._top_ids.extend(update.top_logprobs.ids.tolist())
      self._top_logprobs.extend(update.top_logprobs.logprobs.tolist())
    shown = new[:-1] if done is not None and done.finish_reason == "stop" else new
    reason = None if done is None else done.finish_reason
    delta = ""
    if self._text is None:
      self._shown.extend(shown)
    else:
      delta = self._text.add(shown)
      if self._text.stopped:
        reason = "stop"
      if reason is not None:
        delta += self._text.finish()
      if self._text.stopped:
        del self.tokens[self._text.stop_index:]
        self.cancel = done is None
        self._shown = self._text.ids[:self._covering(self._text.ids[:self._text.stop_index])]
      else:
        self._shown = list(self._text.ids)
    if self._list_stop and done is not None and done.finish_reason == "stop" and reason == "stop" and new \
        and not (self._text is not None and self._text.stopped):
      self._shown.append(new[-1])  # the stop token: listed at the end of the text, showing nothing
    self.finish_reason = reason
    # List the ids whose text is out (all of them once the reply ends); while some text is held back, its ids
    # wait for the piece that shows it.
    held = self._text is not None and self._text.released < len(self._text.text)
    upto = max(len(self._shown) if reason is not None or not held else self._listed, self._listed)
    start, self._listed = self._listed, upto
    return Piece(text=delta, finish_reason=reason, generated=len(self.tokens), ids=self._shown[start:upto],
                 logprobs=self.logprobs[start:upto] if update.logprobs is not None else None,
                 top=((self._top_ids[start:upto], self._top_logprobs[start:upto])
                      if update.top_logprobs is not None else None),
                 offsets=None if self._offsets is None else self._offsets.add(self._shown[start:upto]),
                 cached_tokens=update.cached_tokens)

  def _covering(self, ids: list[int]) -> int:
    """How many of ``ids`` (the ids up to the one that completed a stop string) it takes to spell the text the
    reply keeps (the text before the stop string): the ids of the stop string itself are not listed."""
    kept = len(self._text.text)
    n = len(ids)
    while n > 0 and len(self._tokenizer.decode(ids[:n - 1], skip_special_tokens=self._skip).rstrip("\ufffd")) >= kept:
      n -= 1
    return n


class TextOffsets:
  """Where each token's first character starts in a text the tokens spell, for tokens given in order (a few at a
  time): the index of the character its first byte belongs to (a token inside a multi-byte character starts at
  that character). ``skip_special_tokens``: special tokens take no characters (the text leaves them out)."""

  def __init__(self, token_strings: TokenStrings, skip_special_tokens: bool = False):
    self._strings, self._skip = token_strings, skip_special_tokens
    self._characters = 0  # characters of the text the ids so far account for
    self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

  def add(self, ids: Sequence[int]) -> list[int]:
    offsets = []
    for t in ids:
      raw = self._strings.bytes(t)
      pending = self._utf8.getstate()[0]  # the bytes so far of a character not yet complete
      if raw is None or self._strings.is_special(t):  # held bytes end as U+FFFD(s) before it
        self._characters += len(pending.decode("utf-8", "replace"))
        self._utf8.reset()
        offsets.append(self._characters)
        if not (self._skip and self._strings.is_special(t)):
          self._characters += len(self._strings.text(t))
        continue
      start = self._characters
      if pending and not (raw and _continues(pending, raw[0])):
        start += len(pending.decode("utf-8", "replace"))  # the held bytes end as U+FFFD(s); the token follows
      offsets.append(start)
      self._characters += len(self._utf8.decode(bytes(raw)))
    return offsets


def _continues(pending: bytes, byte: int) -> bool:
  """Whether ``byte`` continues the valid unfinished UTF-8 sequence ``pending``."""
  try:
    codecs.getincrementaldecoder("utf-8")("strict").decode(pending + bytes([byte]))
  except UnicodeDecodeError:
    return False
  return True
