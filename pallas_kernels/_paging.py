"""Paged key/value storage shared by the attention and indexer ops: a pool of fixed-size pages and a page table
per sequence (m3jax.cache.PagedLayerCache builds them; the references read through ``gather_pages``).

Page table row b lists the pool pages of sequence b in order: logical page i holds the sequence's positions
[i * page, (i + 1) * page). -1 marks a page the sequence does not have; reads of it return page 0's contents,
which only positions past the sequence's end (never visible to its real queries, see reference.py) can hit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
  """pool [P, page, ...], page_table int32 [B, n] -> contiguous [B, n * page, ...] (slot j = position j)."""
  b, n = page_table.shape
  rows = pool[jnp.maximum(page_table, 0)]  # [B, n, page, ...]
  return rows.reshape(b, n * pool.shape[1], *pool.shape[2:])


def check_page_table(pool: jax.Array, page_table: jax.Array, batch: int) -> None:
  """ValueError unless page_table is int [batch, n] for a pool [P, page, ...]."""
  if page_table.ndim != 2 or page_table.shape[0] != batch or not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"page_table must be int [B={batch}, pages], got {page_table.dtype}{page_table.shape}")
  if pool.ndim < 3:
    raise ValueError(f"a paged pool must be [pages, page_size, ...], got {pool.shape}")
