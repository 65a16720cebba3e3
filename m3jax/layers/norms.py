"""Gemma RMSNorm (M3_SPEC §2.1): fp32 statistics, scale by (1 + w) in fp32, one cast back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.layers.params import make_param


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """y = cast(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)) over the last axis."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
  """Gemma RMSNorm over the last axis of size ``dim``; the weight is an offset from 1 (zero-initialised)."""

  def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, rngs: nnx.Rngs | None = None):
    self.eps = eps
    self.weight = make_param(rngs, (dim,), dtype, (ax.NORM,), init="zeros")

  def __call__(self, x: jax.Array) -> jax.Array:
    return gemma_rms_norm(x, self.weight[...], self.eps)
