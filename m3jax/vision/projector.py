"""Multimodal projector + patch merge (M3_SPEC §7.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.config import M3Config
from m3jax.vision.layers import V_EMBED, V_MLP, Linear, gelu


class Projector(nnx.Module):
  """Per patch: linear_2(gelu(linear_1(x))) (vision D -> P -> text H); then every run of merge^2 consecutive
  patches (one merge block, thanks to the block-major row order) is concatenated to [merge^2 * H] and fused by
  merge_linear_2(gelu(merge_linear_1(.))) (merge^2 * H -> P -> H)."""

  def __init__(self, config: M3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    v, h = config.vision, config.text.hidden_size
    p = config.projector_hidden_size or h
    self.merge = v.spatial_merge_size ** 2
    bias, merge_bias = v.projector_bias, v.patch_merge_bias
    self.linear_1 = Linear(v.hidden_size, (p,), bias=bias, dtype=dtype, rngs=rngs, axes=(V_EMBED, V_MLP))
    self.linear_2 = Linear(p, (h,), bias=bias, dtype=dtype, rngs=rngs, axes=(V_MLP, V_EMBED))
    self.merge_linear_1 = Linear(self.merge * h, (p,), bias=merge_bias, dtype=dtype, rngs=rngs,
                                 axes=(V_EMBED, V_MLP))
    self.merge_linear_2 = Linear(p, (h,), bias=merge_bias, dtype=dtype, rngs=rngs, axes=(V_MLP, V_EMBED))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [N, D] (N a multiple of merge^2) -> [N / merge^2, H]."""
    y = self.linear_2(gelu(self.linear_1(x)))
    y = y.reshape(y.shape[0] // self.merge, -1)
    return self.merge_linear_2(gelu(self.merge_linear_1(y)))
