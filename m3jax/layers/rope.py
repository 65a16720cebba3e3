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
  """Rotates the first rotary_dim channels of x [B, S, N, D] (NeoX half-split); the rest pass through.

  cos, sin: fp32 [B, S, rotary_dim]. Channel i < rotary_dim / 2 becomes x_i cos_i - x_{i+half} sin_i, channel
  half <= i < rotary_dim becomes x_i cos_i + x_{i-half} sin_i; computed in fp32, returned in x.dtype.
  """
  if x.shape[-1] % cos.shape[-1] == 0:
    return rope_by_swap(x, cos, sin)
  return rope_by_slices(x, cos, sin)


def rope_by_swap(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """apply_partial_rope for D a multiple of rotary_dim, without slicing x (bitwise the same result).

  Every rotary_dim-wide chunk of x swaps its two halves (one reverse); full-width tables (cos 1 and sin 0 past
  rotary_dim, the minus sign of the first half folded into sin) leave the other chunks unchanged. XLA:GPU fuses
  this into one elementwise kernel with its producer, where the slice / concatenate form costs a decode step
  three extra launches per query projection (scripts/bench_decode_ops.py).
  """
  r, d = cos.shape[-1], x.shape[-1]
  half = r // 2
  x32 = x.astype(jnp.float32)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  swapped = jnp.flip(x32.reshape(*x.shape[:-1], d // r, 2, half), axis=-2).reshape(x.shape)
  c_full = jnp.concatenate([c, jnp.ones((*c.shape[:-1], d - r), jnp.float32)], axis=-1)
  s_full = jnp.concatenate([-s[..., :half], s[..., half:], jnp.zeros((*s.shape[:-1], d - r), jnp.float32)], axis=-1)
  return (x32 * c_full + swapped * s_full).astype(x.dtype)


def rope_by_slices(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """apply_partial_rope for any rotary_dim <= D: rotates the first rotary_dim channels, concatenates the rest."""
  r = cos.shape[-1]
  half = r // 2
  x32 = x.astype(jnp.float32)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  rot, rest = x32[..., :r], x32[..., r:]
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  return jnp.concatenate([rot * c + rotated * s, rest], axis=-1).astype(x.dtype)
