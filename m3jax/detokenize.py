"""Streaming detokenisation: token ids arriving a few at a time -> text deltas that never need taking back.

A byte-level BPE token can hold part of a character's UTF-8 bytes; decoding a prefix of the ids then ends in
U+FFFD (the replacement character), which the next token turns into the real character. Printing
``decode(ids)[len(printed):]`` after each token would emit the U+FFFD and then skip the character it became.
``IncrementalText`` holds trailing U+FFFDs back until the character completes (or the text ends), and with stop
strings also holds back a tail that could still grow into one, cutting the text before the first stop string.

Each step decodes only the ids since the last complete character plus a few before them (their text is decoded
too and subtracted, so decoders that treat the first token specially still agree), not the whole sequence: the
cost per token stays flat as the completion grows.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # ids decoded before the window's start, whose text is subtracted again


class IncrementalText:
  """Text of a growing token sequence, released in deltas.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    stop: stop strings; the text ends just before the first occurrence of any of them (``stopped`` is then True).
    skip_special_tokens: leave special tokens (``<bos>``, image markers, ...) out of the text; by default they are
      kept, as the model wrote them.

  ``add(ids)`` -> the newly final text; ``finish()`` -> the rest once no more ids come. The concatenated deltas
  equal ``text``: the decoded ids, cut before the first stop string. ``stop_index``: once stopped, how many ids
  it took to complete the stop string (ids past it are not part of the completion).
  """

  def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = False):
    stop = [stop] if isinstance(stop, str) else list(stop)
    self._skip = bool(skip_special_tokens)
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    self.tokenizer, self.stop = tokenizer, stop
    self.ids: list[int] = []
    self.text = ""  # everything decoded so far (cut at a stop string once one is found)
    self.released = 0  # characters of self.text already handed out
    self.stopped = False
    self.stop_index: int | None = None
    self._settled_ids = 0  # ids whose text is complete (no partial character at its end) ...
    self._settled_text = ""  # ... and that text

  def add(self, ids: Sequence[int]) -> str:
    """Appends ids -> the text now certain (no partial character, no possible stop-string start). With stop
    strings the ids are taken one at a time, so ``stop_index`` is exact; after a stop string, further ids are
    ignored and "" is returned."""
    ids = [int(t) for t in ids]
    steps = [ids[i:i + 1] for i in range(len(ids))] if self.stop else [ids]
    delta = []
    for step in steps:
      if self.stopped:
        break
      delta.append(self._add(step))
    return "".join(delta)

  def finish(self) -> str:
    """No more ids: releases what was held back (a U+FFFD of an unfinished character stays in the text)."""
    return self._release(len(self.text))

  def _add(self, ids: list[int]) -> str:
    self.ids.extend(ids)
    self.text = self._decode()
    if not self.text.endswith(_REPLACEMENT):
      self._settled_ids, self._settled_text = len(self.ids), self.text
    if self._cut_at_stop():
      self.stop_index = len(self.ids)
      return self._release(len(self.text))
    end = len(self.text.rstrip(_REPLACEMENT))  # a partial character may still complete
    hold = 0  # the longest unreleased tail that is a proper prefix of a stop string (it may still become one)
    for s in self.stop:
      hold = max([hold] + [k for k in range(1, min(len(s) - 1, end - self.released) + 1)
                           if self.text[end - k:end] == s[:k]])
    return self._release(end - hold)

  def _decode(self) -> str:
    """The text of all ids: the settled text plus the text the newer ids add after a few settled ones."""
    start = max(0, self._settled_ids - _CONTEXT_TOKENS)
    head = self.tokenizer.decode(self.ids[start:self._settled_ids], skip_special_tokens=self._skip)
    window = self.tokenizer.decode(self.ids[start:], skip_special_tokens=self._skip)
    if start == 0 or not window.startswith(head) or not self._settled_text.endswith(head):
      return self.tokenizer.decode(self.ids, skip_special_tokens=self._skip)  # the window does not line up: all ids
    return self._settled_text + window[len(head):]

  def _cut_at_stop(self) -> bool:
    # Released text holds no stop string and does not end in a proper prefix of one, so a stop string starts in
    # the unreleased text: searching from the release point finds the first one.
    hits = [i for i in (self.text.find(s, self.released) for s in self.stop) if i >= 0]
    if not hits:
      return False
    self.text, self.stopped = self.text[:min(hits)], True
    return True

  def _release(self, end: int) -> str:
    end = max(end, self.released)
    delta, self.released = self.text[self.released:end], end
    return delta


class TokenStrings:
  """Each token's own text and bytes (what APIs that list per-token log-probabilities show), cached per id.

  ``bytes(id)`` is exact for byte-level BPE vocabularies (M3's): a token holding part of a character's UTF-8
  bytes has text U+FFFD but its true bytes. For other decoders it is the text's UTF-8, or None when the token
  alone does not decode to whole characters.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    self._byte_level = "ByteLevel" in kinds
    self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    self._cache: dict[int, tuple[str, list[int] | None]] = {}

  def text(self, token_id: int) -> str:
    return self._get(int(token_id))[0]

  def is_special(self, token_id: int) -> bool:
    """A special token (``<bos>``, image markers, ...): what ``skip_special_tokens`` leaves out of text."""
    return int(token_id) in self._special

  def key(self, token_id: int) -> str:
    """The token as OpenAI's completions logprobs name it: its text when its bytes are whole UTF-8 characters,
    else ``bytes:\\xNN...`` (its bytes, escaped), so that distinct tokens get distinct names (many byte tokens
    share the text U+FFFD)."""
    raw = self._get(int(token_id))[1]
    if raw is None:  # a token of a decoder whose bytes are not known, holding part of a character
      return f"token_id:{int(token_id)}"
    try:
      return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
      return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

  def bytes(self, token_id: int) -> list[int] | None:
    return self._get(int(token_id))[1]

  def _get(self, token_id: int) -> tuple[str, list[int] | None]:
    if token_id not in self._cache:
      text = self.tokenizer.decode([token_id], skip_special_tokens=False)
      piece = self.tokenizer.id_to_token(token_id) or ""
      table = _byte_level_table()
      if token_id in self._special:
        raw = list(piece.encode())
      elif self._byte_level and piece and all(c in table for c in piece):
        raw = [table[c] for c in piece]
      else:
        raw = None if _REPLACEMENT in text else list(text.encode())
      self._cache[token_id] = (text, raw)
    return self._cache[token_id]


@functools.cache
def _byte_level_table() -> dict[str, int]:
  """Byte-level BPE's printable stand-ins, inverted: bytes that print as themselves (``!``..``~``, ``¡``..``¬``,
  ``®``..``ÿ``) map from their own character; the other 68 byte values, in order, from U+0100, U+0101, ..."""
  printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
  others = [b for b in range(256) if b not in printable]
  return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}
