"""Per-layer decode caches: functional pytrees, anchored to each sequence's own positions.

Slot j of sequence b holds the token at position j of that sequence (never left-padded), so block ids of
the sparse layers are position // block_size for every sequence independently. Writes at positions beyond
the cache length are dropped by the scatter; callers validate lengths before any compute.

``LayerCache`` gives each sequence its own rows; ``PagedLayerCache`` (m3jax.engine) holds one pool of pages per
layer and a page table per sequence, so sequences take pages as they grow and may share full pages (a prefix).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m3jax import logical_axes as ax
from m3jax.sharding import constrain
from pallas_kernels._paging import gather_pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """K/V (post-norm, post-RoPE) [B, S_max, Nkv, D]; sparse layers add index keys idx_k [B, S_max, Di]."""

  k: jax.Array
  v: jax.Array
  idx_k: jax.Array | None = None

  LOGICAL_AXES = {
      "k": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_HEADS, ax.CACHE_DIM),
      "v": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_HEADS, ax.CACHE_DIM),
      "idx_k": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_DIM),
  }

  @property
  def max_length(self) -> int:
    return self.k.shape[1]

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @classmethod
  def zeros(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, index_head_dim: int | None,
            dtype: jnp.dtype) -> "LayerCache":
    kv = jnp.zeros((batch, max_length, num_kv_heads, head_dim), dtype)
    idx = None if index_head_dim is None else jnp.zeros((batch, max_length, index_head_dim), dtype)
    return cls(k=kv, v=kv, idx_k=idx).constrained()

  def constrained(self) -> "LayerCache":
    """This cache laid out by the active sharding plan (``LOGICAL_AXES``; m3jax.sharding); identity without."""
    idx = None if self.idx_k is None else constrain(self.idx_k, self.LOGICAL_AXES["idx_k"])
    return LayerCache(k=constrain(self.k, self.LOGICAL_AXES["k"]), v=constrain(self.v, self.LOGICAL_AXES["v"]),
                      idx_k=idx)

  def write(self, positions: jax.Array, k: jax.Array, v: jax.Array, idx_k: jax.Array | None) -> "LayerCache":
    """Stores new entries at [b, positions[b, s]]: k/v [B, S, Nkv, D], idx_k [B, S, Di]."""
    b = jnp.arange(positions.shape[0])[:, None]
    new_k = self.k.at[b, positions].set(k.astype(self.k.dtype), mode="drop")
    new_v = self.v.at[b, positions].set(v.astype(self.v.dtype), mode="drop")
    new_idx = self.idx_k
    if self.idx_k is not None:
      if idx_k is None:
        raise ValueError("this layer's cache holds index keys; idx_k must be given")
      new_idx = self.idx_k.at[b, positions].set(idx_k.astype(self.idx_k.dtype), mode="drop")
    return LayerCache(k=new_k, v=new_v, idx_k=new_idx).constrained()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayerCache:
  """One layer's pool of pages and the page tables of the sequences of a call.

  k, v: [P, page, Nkv, D] (post-norm, post-RoPE); idx_k: [P, page, Di] on sparse layers (the index keys are paged
  with the K/V, so a shared prefix page carries them too); page_table: int32 [B, max_pages], row b the pool pages
  of sequence b in order (logical page i = positions [i * page, (i + 1) * page)), -1 where it has none. Writes to
  a position whose page is -1 (or past the table) are dropped; reads of such a page return page 0's contents,
  which only positions past a sequence's end can hit (never visible to its real queries).
  """

  k: jax.Array
  v: jax.Array
  idx_k: jax.Array | None
  page_table: jax.Array

  LOGICAL_AXES = {
      "k": (None, None, ax.CACHE_HEADS, ax.CACHE_DIM),
      "v": (None, None, ax.CACHE_HEADS, ax.CACHE_DIM),
      "idx_k": (None, None, ax.CACHE_DIM),
  }

  @property
  def page_size(self) -> int:
    return self.k.shape[1]

  @property
  def num_pages(self) -> int:
    return self.k.shape[0]

  @property
  def max_length(self) -> int:
    """The most positions one sequence can address (its page table's width in tokens)."""
    return self.page_table.shape[1] * self.page_size

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @classmethod
  def zeros(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, index_head_dim: int | None,
            dtype: jnp.dtype) -> "PagedLayerCache":
    """A zeroed pool with an empty page table [0, 1] (the caller sets the table of each call: ``with_table``)."""
    kv = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype)
    idx = None if index_head_dim is None else jnp.zeros((num_pages, page_size, index_head_dim), dtype)
    return cls(k=kv, v=kv, idx_k=idx, page_table=jnp.full((0, 1), -1, jnp.int32)).constrained()

  def with_table(self, page_table: jax.Array) -> "PagedLayerCache":
    """The same pool read and written through ``page_table`` int32 [B, max_pages]."""
    return dataclasses.replace(self, page_table=page_table.astype(jnp.int32))

  def constrained(self) -> "PagedLayerCache":
    """The pools laid out by the active sharding plan (heads split like LayerCache's); identity without."""
    idx = None if self.idx_k is None else constrain(self.idx_k, self.LOGICAL_AXES["idx_k"])
    return PagedLayerCache(k=constrain(self.k, self.LOGICAL_AXES["k"]), v=constrain(self.v, self.LOGICAL_AXES["v"]),
                           idx_k=idx, page_table=self.page_table)

  def slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int32 [B, S] -> (pool page, offset in it) int32 [B, S] each; the page is P (out of the pool: a
    dropped write) where the sequence has no page for the position."""
    page = self.page_size
    logical = positions // page
    inside = (positions >= 0) & (logical < self.page_table.shape[1])
    phys = jnp.take_along_axis(self.page_table, jnp.clip(logical, 0, self.page_table.shape[1] - 1), axis=1)
    phys = jnp.where(inside & (phys >= 0), phys, self.num_pages)
    return phys, positions % page

  def write(self, positions: jax.Array, k: jax.Array, v: jax.Array, idx_k: jax.Array | None) -> "PagedLayerCache":
    """Stores new entries of sequence b at its pages for positions[b, s]: k/v [B, S, Nkv, D], idx_k [B, S, Di]."""
    phys, offset = self.slots(positions)
    new_k = self.k.at[phys, offset].set(k.astype(self.k.dtype), mode="drop")
    new_v = self.v.at[phys, offset].set(v.astype(self.v.dtype), mode="drop")
    new_idx = self.idx_k
    if self.idx_k is not None:
      if idx_k is None:
        raise ValueError("this layer's cache holds index keys; idx_k must be given")
      new_idx = self.idx_k.at[phys, offset].set(idx_k.astype(self.idx_k.dtype), mode="drop")
    return PagedLayerCache(k=new_k, v=new_v, idx_k=new_idx, page_table=self.page_table).constrained()

  def contiguous(self) -> LayerCache:
    """The sequences' caches gathered into rows [B, max_length, ...] (slot j = position j): what a reader that
    does not take page tables sees (research records, multi-device plans)."""
    idx = None if self.idx_k is None else gather_pages(self.idx_k, self.page_table)
    return LayerCache(k=gather_pages(self.k, self.page_table), v=gather_pages(self.v, self.page_table), idx_k=idx)
