"""Attention ops (dense causal and block-sparse GQA) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax.ops.dispatch import KernelChoice, run_op
from m3jax.parallel import heads as sharded
from pallas_kernels.attention.reference import causal_attention_reference, sparse_attention_reference


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *, scale: float,
                     kernels: KernelChoice) -> jax.Array:
  """q [B,Sq,Nq,D], k/v [B,Sk,Nkv,D] (slot j = position j), q_positions [B,Sq] -> [B,Sq,Nq,D].

  Under a multi-device sharding plan it runs per device on its batch rows / heads / query tokens.
  """
  def op(q, k, v, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.attention", kernel_name="causal_attention",
                  reference=causal_attention_reference, args=(q, k, v, q_positions), kwargs=dict(scale=scale))

  return sharded.attention(op, q, k, v, None, q_positions)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_ids: jax.Array, q_positions: jax.Array, *,
                     block_size: int, scale: float, kernels: KernelChoice) -> jax.Array:
  """As causal_attention, restricted to the selected key blocks block_ids [B,Sq,Nkv,T] (-1 = empty)."""
  def op(q, k, v, block_ids, q_positions):
    return run_op(kernels, kernel_module="pallas_kernels.attention", kernel_name="sparse_attention",
                  reference=sparse_attention_reference, args=(q, k, v, block_ids, q_positions),
                  kwargs=dict(block_size=block_size, scale=scale))

  return sharded.attention(op, q, k, v, block_ids, q_positions)
