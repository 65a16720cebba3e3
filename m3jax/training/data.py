"""Corpus reading, the held-out split, packing documents into fixed-length rows, and the batch of each step.

A corpus is a UTF-8 text file or a directory of them (every ``*.txt`` below it, in sorted order). Documents
are separated by blank lines. Each document becomes ``<bos> tokens <eos>``; the documents of a split are
concatenated and cut into rows of ``seq_len`` tokens (a row may span a document boundary, as in GPT-style
packing; attention is not reset there). The tail shorter than a row is reported (``PackedSplit.dropped``).
The batch of step i is a pure function of (rows, seed, i), so a resumed run reads exactly the batches the
uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import numpy as np

_DOC_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


class CorpusError(ValueError):
  """A corpus that cannot be trained on (missing, empty, not UTF-8, too small for a split)."""


def corpus_files(path: str | os.PathLike) -> list[str]:
  """The text files of a corpus path: the file itself, or every ``*.txt`` under the directory (sorted)."""
  path = os.fspath(path)
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    raise CorpusError(f"{path}: no such corpus file or directory")
  files = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f.endswith(".txt"))
  if not files:
    raise CorpusError(f"{path}: a directory without any *.txt file")
  return files


def read_documents(path: str | os.PathLike) -> list[str]:
  """Every non-blank document of the corpus, in order; CorpusError naming the file for non-UTF-8 bytes or a
  corpus without text."""
  docs: list[str] = []
  for file in corpus_files(path):
    with open(file, "rb") as f:
      raw = f.read()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise CorpusError(f"{file}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
    docs += [d.strip() for d in _DOC_BREAK.split(text.replace("\r\n", "\n")) if d.strip()]
  if not docs:
    raise CorpusError(f"{os.fspath(path)}: the corpus holds no text")
  return docs


def split_documents(docs: Sequence[str], holdout_fraction: float, seed: int) -> tuple[list[str], list[str]]:
  """(train, validation) documents: a seeded random ``holdout_fraction`` of them (at least one) held out;
  each split keeps the corpus order."""
  if not 0.0 < holdout_fraction < 1.0:
    raise CorpusError(f"holdout fraction must be in (0, 1), got {holdout_fraction}")
  if len(docs) < 2:
    raise CorpusError(f"the corpus has {len(docs)} document(s); a held-out split needs at least 2 (documents are "
                      "separated by blank lines)")
  n_val = min(len(docs) - 1, max(1, round(len(docs) * holdout_fraction)))
  held = set(np.random.default_rng(seed).permutation(len(docs))[:n_val].tolist())
  return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])


@dataclasses.dataclass(frozen=True)
class PackedSplit:
  """rows int32 [N, seq_len]; tokens: the split's token count; dropped: tail tokens that fill no row."""

  rows: np.ndarray
  tokens: int
  dropped: int


def pack_documents(token_lists: Sequence[Sequence[int]], seq_len: int, bos: int, eos: int, what: str
                   ) -> PackedSplit:
  """``<bos> doc <eos>`` for every document, concatenated and cut into rows of ``seq_len`` tokens."""
  stream = np.concatenate([np.asarray([bos, *ids, eos], np.int32) for ids in token_lists])
  n = len(stream) // seq_len
  if n == 0:
    raise CorpusError(f"the {what} split has {len(stream)} tokens, fewer than one row of {seq_len}; use a larger "
                      "corpus, a shorter --seq-len or a different holdout fraction")
  return PackedSplit(rows=stream[:n * seq_len].reshape(n, seq_len), tokens=len(stream),
                     dropped=len(stream) - n * seq_len)


def batch_indices(num_rows: int, batch: int, step: int, seed: int) -> np.ndarray:
  """Row indices int [batch] of training step ``step`` (0-based): consecutive slices of one seeded permutation
  of the rows per epoch, epochs chained, so every row is seen once per epoch."""
  epochs, positions = np.divmod(np.arange(step * batch, (step + 1) * batch), num_rows)
  perms = {int(e): np.random.default_rng([seed, int(e)]).permutation(num_rows) for e in np.unique(epochs)}
  return np.asarray([perms[int(e)][p] for e, p in zip(epochs, positions)], np.int64)
