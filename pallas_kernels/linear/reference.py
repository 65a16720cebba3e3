"""Pure-jnp reference of a dense projection by a block-scaled fp8 weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import QuantizedWeight, dequantize


@jax.jit
def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
  """x [T, in] @ w.T -> [T, out] in x.dtype.

  The weight [out, in] is dequantized to x.dtype (exact for mxfp8 in bf16 and fp32), then multiplied with fp32
  accumulation (full fp32 precision when x is fp32), as the bf16 / fp32 projections of the model are.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"quantized_matmul needs x [T, in] and w [out, in] with the same in, got {x.shape} and "
                     f"{w.shape}")
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  y = jnp.dot(x, dequantize(w, x.dtype).T, preferred_element_type=jnp.float32, precision=precision)
  return y.astype(x.dtype)
