"""VisionModel = vision tower + projector: pixel rows -> one LLM embedding per 2x2 merge block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.config import M3Config
from m3jax.vision.projector import Projector
from m3jax.vision.tower import VisionTower


class VisionModel(nnx.Module):
  """The ``vision`` submodule of M3ForCausalLM (M3_SPEC §7.1-7.5)."""

  def __init__(self, config: M3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    if config.vision is None:
      raise ValueError("VisionModel needs a config with a vision_config")
    self.config = config
    self.tower = VisionTower(config.vision, dtype=dtype, rngs=rngs)
    self.projector = Projector(config, dtype=dtype, rngs=rngs)

  def __call__(self, pixel_values: jax.Array, positions: jax.Array, pack_index: jax.Array,
               pack_valid: jax.Array, unpack_index: jax.Array) -> jax.Array:
    """pixel rows [N, C*T*P*P] (+ the ``grid.VisionLayout`` arrays) -> features [N / merge^2, H]."""
    return self.projector(self.tower(pixel_values, positions, pack_index, pack_valid, unpack_index))
