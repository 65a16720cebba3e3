"""The vision tower (M3_SPEC §7.1-7.4): Conv3d patch embedding (a matmul, no bias) -> pre-LayerNorm ->
CLIP encoder layers with 3-D axial RoPE, attention restricted to segments, no post-norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax import sharding
from m3jax.config import VisionConfig
from m3jax.layers.params import make_param, project
from m3jax.vision.layers import V_EMBED, V_PATCH, LayerNorm, VisionEncoderLayer
from m3jax.vision.rope import axial_cos_sin


def patch_dim(cfg: VisionConfig) -> int:
  """Values per pixel row: C * T * P * P (3 * 2 * 14 * 14 = 1176), ordered (C, T, py, px)."""
  return cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size ** 2


class VisionTower(nnx.Module):
  """pixel rows [N, C*T*P*P] -> last-layer hidden states [N, D] (packed by a ``grid.VisionLayout``)."""

  def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    self.config = cfg
    self.dtype = jnp.dtype(dtype)
    self.patch_embed = make_param(rngs, (patch_dim(cfg), cfg.hidden_size), dtype, (V_PATCH, V_EMBED))
    self.pre_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([
        VisionEncoderLayer(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, eps=cfg.layer_norm_eps,
                           dtype=dtype, rngs=rngs)
        for _ in range(cfg.num_layers)])

  def __call__(self, pixel_values: jax.Array, positions: jax.Array, pack_index: jax.Array,
               pack_valid: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """Runs the tower.

    Args:
      pixel_values: float [N, C*T*P*P] (HF's flattened patch rows).
      positions: int32 [N, 3] (t, h, w) RoPE coordinates.
      pack_index: int32 [S, L] row of each (segment, slot), N for padding; pack_valid: bool [S, L].
      unpack_index: int32 [N] flat slot of each row.

    Returns:
      [N, D] hidden states of the last encoder layer, in the model dtype.
    """
    cfg = self.config
    n = pixel_values.shape[0]
    x = project("np,pd->nd", pixel_values.astype(self.dtype), self.patch_embed[...])
    x = self.pre_norm(x)
    x = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[pack_index]  # [S, L, D]
    # Segments (images / video chunks) never attend to each other: data parallel over them on a mesh.
    x = sharding.constrain(x, (ax.ACT_VISION_SEGMENTS, None, None))
    pos = jnp.concatenate([positions, jnp.zeros((1, 3), positions.dtype)])[pack_index]
    cos, sin = axial_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    for layer in self.layers:
      x = layer(x, cos, sin, pack_valid)
    return x.reshape(-1, x.shape[-1])[unpack_index][:n]
