"""Host-side bookkeeping of a paged KV cache (m3jax.engine): which pool pages are free, which a sequence holds, and
which full pages are kept for prefix reuse.

A page is shareable once full: its key is the hash chain of the tokens of every page up to and including it
(``page_digests``), so two sequences share a page only when their whole prefix up to its end is the same. Shared
pages are read-only (a sequence writes only positions past its shared prefix). A page whose last holder let it go
stays cached, evictable in least-recently-released order, until the pool needs it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np


def page_digests(tokens: Sequence[int], page_size: int, count: int, parent: bytes = b"") -> list[bytes]:
  """The chain keys of the first ``count`` full pages of ``tokens``: key i = sha256(key i-1, page i's tokens)
  (``parent`` is key -1), so a page's key depends on its tokens and the pages before it only. ``tokens`` are
  content keys (m3jax.content_keys): token ids, and at a multimodal prompt's image / video placeholders a
  (negative) fingerprint of their embeddings, so a page holding other images behind the same ids has another key."""
  keys, key = [], parent
  for i in range(count):
    page = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64)
    if page.size != page_size:
      raise ValueError(f"page {i} of {len(tokens)} tokens is not full (page size {page_size})")
    key = hashlib.sha256(key + page.tobytes()).digest()
    keys.append(key)
  return keys


@dataclasses.dataclass
class PrefixCounters:
  """Prefix-cache lookups so far: prompt tokens looked up (those a hit could cover) and tokens served from the
  cache."""

  query_tokens: int = 0
  hit_tokens: int = 0


class PagePool:
  """Free / held / cached pages of a pool of ``num_pages`` pages of ``page_size`` tokens.

  Held pages have a reference count (one per sequence holding them); a cached page with no holder is evictable.
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
    self.num_pages, self.page_size = num_pages, page_size
    self._free: collections.deque[int] = collections.deque(range(num_pages))
    self._refs = [0] * num_pages
    self._by_key: dict[bytes, int] = {}
    self._key_of: dict[int, bytes] = {}
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest release first
    self.counters = PrefixCounters()

  @property
  def available(self) -> int:
    """Pages an allocation can take: free ones and cached ones nobody holds."""
    return len(self._free) + len(self._evictable)

  @property
  def in_use(self) -> int:
    """Pages held by at least one sequence."""
    return self.num_pages - self.available

  @property
  def cached(self) -> int:
    """Full pages kept for prefix reuse (held or not)."""
    return len(self._key_of)

  def allocate(self) -> int | None:
    """A page for one holder: a free one, else the least recently released cached one (dropped from the cache);
    None when every page is held."""
    if self._free:
      page = self._free.popleft()
    elif self._evictable:
      page, _ = self._evictable.popitem(last=False)
      del self._by_key[self._key_of.pop(page)]
    else:
      return None
    self._refs[page] = 1
    return page

  def peek(self, keys: Sequence[bytes]) -> tuple[int, int]:
    """(how many leading ``keys`` are cached, how many of those pages nobody holds: taking them lowers
    ``available``); no holder taken."""
    n = unheld = 0
    while n < len(keys) and keys[n] in self._by_key:
      unheld += self._by_key[keys[n]] in self._evictable
      n += 1
    return n, unheld

  def acquire_prefix(self, keys: Sequence[bytes], lookup_tokens: int) -> list[int]:
    """The cached pages of the longest cached run of ``keys`` (each now held once more); counts a lookup of
    ``lookup_tokens`` tokens and its hit."""
    pages = []
    for key in keys:
      page = self._by_key.get(key)
      if page is None:
        break
      self._evictable.pop(page, None)
      self._refs[page] += 1
      pages.append(page)
    self.counters.query_tokens += lookup_tokens
    self.counters.hit_tokens += len(pages) * self.page_size
    return pages

  def register(self, page: int, key: bytes) -> None:
    """Marks held, full ``page`` as the cached page of ``key`` (kept as is when key or page is already cached)."""
    if key not in self._by_key and page not in self._key_of:
      self._by_key[key] = page
      self._key_of[page] = key

  def release(self, pages: Sequence[int]) -> None:
    """One holder lets ``pages`` go: a page nobody holds is freed, or kept evictable if cached."""
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] < 0:
        raise RuntimeError(f"page {page} released more often than held")
      if self._refs[page] == 0:
        if page in self._key_of:
          self._evictable[page] = None
        else:
          self._free.append(page)

  def clear(self) -> None:
    """Forgets every holder and cached page (the pool's contents were lost)."""
    self._free = collections.deque(range(self.num_pages))
    self._refs = [0] * self.num_pages
    self._by_key.clear()
    self._key_of.clear()
    self._evictable.clear()
