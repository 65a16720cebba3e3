"""Lightning-indexer op (scores -> block max -> top-k selection) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax.ops.dispatch import KernelChoice, run_op
from m3jax.parallel import heads as sharded
from pallas_kernels._paging import gather_pages
from pallas_kernels.indexer.reference import indexer_topk_reference


def indexer_topk(idx_q: jax.Array, idx_k: jax.Array, q_positions: jax.Array, *, block_size: int, topk: int,
                 local_blocks: int, init_blocks: int, kernels: KernelChoice,
                 page_table: jax.Array | None = None) -> jax.Array:
  """idx_q [B,Sq,Hi,Di], idx_k [B,Sk,Di], q_positions [B,Sq] -> int32 block ids [B,Sq,Hi,topk] (-1 padded).

  page_table: int32 [B, n] when idx_k is a pool of pages [P, page, Di] (m3jax.cache.PagedLayerCache). Under a
  multi-device sharding plan it runs per device on its batch rows / index heads / query tokens (a paged cache is
  gathered into rows first).
  """
  if page_table is not None and sharded.plan_active():
    idx_k, page_table = gather_pages(idx_k, page_table), None
  paged = {} if page_table is None else {"page_table": page_table}

  def op(idx_q, idx_k, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.indexer", kernel_name="indexer_topk",
                  reference=indexer_topk_reference, args=(idx_q, idx_k, q_positions),
                  kwargs=dict(block_size=block_size, topk=topk, local_blocks=local_blocks,
                              init_blocks=init_blocks, **paged))

  if paged:
    return op(idx_q, idx_k, q_positions)
  return sharded.indexer(op, idx_q, idx_k, q_positions)
