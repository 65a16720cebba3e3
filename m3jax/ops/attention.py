"""Attention ops (dense causal and block-sparse GQA) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax.ops.dispatch import KernelChoice, run_op
from m3jax.parallel import heads as sharded
from pallas_kernels._paging import gather_pages
from pallas_kernels.attention.reference import causal_attention_reference, sparse_attention_reference


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *, scale: float,
                     kernels: KernelChoice, page_table: jax.Array | None = None) -> jax.Array:
  """q [B,Sq,Nq,D], k/v [B,Sk,Nkv,D] (slot j = position j), q_positions [B,Sq] -> [B,Sq,Nq,D].

  page_table: int32 [B, n] when k, v are pools of pages [P, page, Nkv, D] (m3jax.cache.PagedLayerCache); the
  ops read them through it. Under a multi-device sharding plan it runs per device on its batch rows / heads /
  query tokens (a paged cache is gathered into rows first).
  """
  if page_table is not None and sharded.plan_active():
    k, v, page_table = gather_pages(k, page_table), gather_pages(v, page_table), None
  paged = {} if page_table is None else {"page_table": page_table}

  def op(q, k, v, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.attention", kernel_name="causal_attention",
                  reference=causal_attention_reference, args=(q, k, v, q_positions), kwargs=dict(scale=scale, **paged))

  if paged:
    return op(q, k, v, q_positions)
  return sharded.attention(op, q, k, v, None, q_positions)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_ids: jax.Array, q_positions: jax.Array, *,
                     block_size: int, scale: float, kernels: KernelChoice,
                     page_table: jax.Array | None = None) -> jax.Array:
  """As causal_attention, restricted to the selected key blocks block_ids [B,Sq,Nkv,T] (-1 = empty); with a
  page_table, block i of sequence b is read from its page table's entry i (pages of block_size tokens)."""
  if page_table is not None and sharded.plan_active():
    k, v, page_table = gather_pages(k, page_table), gather_pages(v, page_table), None
  paged = {} if page_table is None else {"page_table": page_table}

  def op(q, k, v, block_ids, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.attention", kernel_name="sparse_attention",
                  reference=sparse_attention_reference, args=(q, k, v, block_ids, q_positions),
                  kwargs=dict(block_size=block_size, scale=scale, **paged))

  if paged:
    return op(q, k, v, block_ids, q_positions)
  return sharded.attention(op, q, k, v, block_ids, q_positions)
