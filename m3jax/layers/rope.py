"""Partial NeoX ("half-split") rotary embedding (M3_SPEC §2.3 step 3), cos/sin and rotation in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin fp32 [B, S, rotary_dim] for int positions [B, S]; inv_freq_i = theta^(-2i / rotary_dim)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates the first rotary_dim channels of x [B, S, N, D] (NeoX half-split); the rest pass through."""
  r = cos.shape[-1]
  x32 = x.astype(jnp.float32)
  rot, rest = x32[..., :r], x32[..., r:]
  half = r // 2
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([rot * c + rotated * s, rest], axis=-1).astype(x.dtype)
