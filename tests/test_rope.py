"""Partial NeoX RoPE: both formulations against a float64 rotation, and bitwise against each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.layers.rope import apply_partial_rope, rope_by_slices, rope_by_swap, rope_cos_sin


def _rotate64(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
  """The spec's rotation in float64: first half x_i cos - x_{i+h} sin, second x_i cos + x_{i-h} sin, rest kept."""
  r = cos.shape[-1]
  h = r // 2
  x = x.astype(np.float64)
  c, s = cos[:, :, None, :].astype(np.float64), sin[:, :, None, :].astype(np.float64)
  out = x.copy()
  out[..., :h] = x[..., :h] * c[..., :h] - x[..., h:r] * s[..., :h]
  out[..., h:r] = x[..., h:r] * c[..., h:r] + x[..., :h] * s[..., h:r]
  return out


@pytest.mark.parametrize("d,r", [(128, 64), (128, 128), (64, 16), (80, 78), (48, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_matches_float64_rotation(d, r, dtype):
  positions = jnp.asarray([[0, 1, 7, 4095], [9, 100, 3000, 131071]], jnp.int32)
  cos, sin = rope_cos_sin(positions, r, 5e6)
  x = jax.random.normal(jax.random.key(d * r), (2, 4, 3, d), jnp.float32).astype(dtype)
  y = apply_partial_rope(x, cos, sin)
  assert y.dtype == dtype and y.shape == x.shape
  want = _rotate64(np.asarray(x, np.float64), np.asarray(cos), np.asarray(sin))
  tol = 1e-6 if dtype == jnp.float32 else 8e-3  # one final rounding to the output dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tol * 4, rtol=tol)
  np.testing.assert_array_equal(np.asarray(y[..., r:]), np.asarray(x[..., r:]))  # pass-through channels


@pytest.mark.parametrize("d,r", [(128, 64), (128, 128), (64, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.quick
def test_swap_form_is_bitwise_the_slice_form(d, r, dtype):
  positions = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) * 1237
  cos, sin = rope_cos_sin(positions, r, 1e4)
  x = jax.random.normal(jax.random.key(r), (2, 5, 4, d), jnp.float32).astype(dtype)
  np.testing.assert_array_equal(np.asarray(rope_by_swap(x, cos, sin)), np.asarray(rope_by_slices(x, cos, sin)))
