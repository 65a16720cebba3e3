"""Pure-jnp references of a dense projection by a block-scaled fp8 weight and of a dense MLP with fp8 weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import gated_mlp
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


@functools.partial(jax.jit, static_argnames=("alpha", "limit"))
def quantized_gated_mlp_reference(x: jax.Array, w_gate_up: QuantizedWeight, w_down: QuantizedWeight, *,
                                  alpha: float, limit: float) -> jax.Array:
  """Dense SwiGLU-OAI MLP with fp8 weights gate_up [2F, H] / down [H, F]: x [T, H] -> [T, H] in x.dtype.

  ``pallas_kernels.moe.reference.gated_mlp`` on the weights dequantized to x.dtype: fp32 gate_up product, fp32
  SwiGLU-OAI, one rounding of the activation to x.dtype, fp32-accumulated down product."""
  return gated_mlp(x, w_gate_up, w_down, alpha=alpha, limit=limit)
