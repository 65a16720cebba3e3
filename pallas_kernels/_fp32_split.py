"""fp32 operands on bf16 tensor cores: a = hi + lo with hi, lo bf16 (3-pass products hi.hi + hi.lo + lo.hi).

Shared by the MoE and indexer kernels' fp32 paths: ``split3_lhs`` / ``split3_rhs`` stack the parts along the
contraction axis so that one bf16 product of the two gives the 3-pass sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_hi_lo(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """fp32 [...] -> (hi, lo) bf16 [...] with a ~= hi + lo (to ~2^-17 relative).

  hi rounds the mantissa with integer ops. The obvious float round trip, ``lo = a - a.astype(bf16).astype(f32)``,
  is folded to lo == 0 by XLA:GPU's excess-precision simplification (the convert pair is removed), which leaves
  bf16 accuracy on the GPU while the CPU keeps lo (measured on the H200: BENCHMARKS.md).
  """
  a = a.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
  bits = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)  # round to nearest bf16 (ties away from zero)
  hi = jax.lax.bitcast_convert_type(bits, jnp.float32)  # exactly representable in bf16
  return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def split3_lhs(a: jax.Array, axis: int = -1) -> jax.Array:
  """fp32 left operand -> bf16 [hi, hi, lo] stacked along its contraction ``axis`` (3x as long)."""
  hi, lo = split_hi_lo(a)
  return jnp.concatenate([hi, hi, lo], axis=axis)


def split3_rhs(b: jax.Array, axis: int = -2) -> jax.Array:
  """fp32 right operand -> bf16 [hi; lo; hi] stacked along its contraction ``axis`` (pairs with ``split3_lhs``)."""
  hi, lo = split_hi_lo(b)
  return jnp.concatenate([hi, lo, hi], axis=axis)
