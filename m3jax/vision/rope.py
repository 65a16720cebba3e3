"""3-D axial RoPE of the vision tower (M3_SPEC §7.3), cos/sin in fp32.

Each of the t, h and w axes gets the same ``F = floor(floor(head_dim / 3) / 2)`` frequencies
``theta^(-2j / 2F)``; per token the angle vector is ``[t * inv, h * inv, w * inv]`` (3F values) and
cos/sin are that vector repeated twice (NeoX half-split), so ``6F`` channels rotate (78 of 80 for M3) and the
rest of the head passes through. The rotation itself is ``m3jax.layers.rope.apply_partial_rope``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def axial_rotary_dim(head_dim: int) -> int:
  """Rotated channels per head: 3 axes x 2 x F with F = floor(floor(head_dim / 3) / 2) (78 for 80)."""
  return 3 * 2 * ((head_dim // 3) // 2)


def axial_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """positions int [..., 3] (t, h, w) -> cos, sin fp32 [..., axial_rotary_dim(head_dim)]."""
  axis_dim = 2 * ((head_dim // 3) // 2)
  inv_freq = 1.0 / (theta ** (jnp.arange(0, axis_dim, 2, dtype=jnp.float32) / axis_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., 3, F]
  freqs = freqs.reshape(*positions.shape[:-1], -1)  # [..., 3F] in (t, h, w) order
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)
