"""Parameter creation and projection helpers shared by the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def make_param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    axes: tuple[str, ...],
    *,
    init: str = "normal",
    std: float = 0.02,
) -> nnx.Param:
  """An nnx.Param with logical axis names (``init``: 'normal' (std), or 'zeros')."""
  if len(axes) != len(shape):
    raise ValueError(f"{len(axes)} logical axes {axes} for a parameter of shape {shape}")
  if init == "zeros" or rngs is None:
    value = jnp.zeros(shape, dtype)
  else:
    # Drawn directly in the parameter dtype: no fp32 transient when initialising large bf16 models.
    value = jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def project(eq: str, x: jax.Array, w: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
  """einsum in x.dtype with fp32 accumulation (full fp32 precision when activations are fp32)."""
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  y = jnp.einsum(eq, x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision)
  return y.astype(out_dtype or x.dtype)
