"""Lightning-indexer op (scores -> block max -> top-k selection) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax.ops.dispatch import KernelChoice, run_op
from m3jax.parallel import heads as sharded
from pallas_kernels.indexer.reference import indexer_topk_reference


def indexer_topk(idx_q: jax.Array, idx_k: jax.Array, q_positions: jax.Array, *, block_size: int, topk: int,
                 local_blocks: int, init_blocks: int, kernels: KernelChoice) -> jax.Array:
  """idx_q [B,Sq,Hi,Di], idx_k [B,Sk,Di], q_positions [B,Sq] -> int32 block ids [B,Sq,Hi,topk] (-1 padded).

  Under a multi-device sharding plan it runs per device on its batch rows / index heads / query tokens.
  """
  def op(idx_q, idx_k, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.indexer", kernel_name="indexer_topk",
                  reference=indexer_topk_reference, args=(idx_q, idx_k, q_positions),
                  kwargs=dict(block_size=block_size, topk=topk, local_blocks=local_blocks,
                              init_blocks=init_blocks))

  return sharded.indexer(op, idx_q, idx_k, q_positions)
