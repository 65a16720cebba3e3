"""tests/fast_interpret_callbacks.py: the faster host side of interpret mode's io_callbacks changes no result.

Each kernel family runs once in the Mosaic GPU interpreter with jax's own ``io_callback_impl`` and once with the
replacement, on the same compiled program: the outputs must be bit-identical.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fast_interpret_callbacks as fast
import kernel_modes
from pallas_kernels.attention import sparse_attention
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.moe import MoeBlockSizes, moe_block

pytestmark = kernel_modes.CPU_ONLY


def _both_ways(fn) -> tuple[np.ndarray, np.ndarray]:
  """``fn()`` with jax's io_callback_impl, then with the replacement; restores what was installed."""
  was_installed = fast.installed()
  try:
    fast.uninstall()
    original = np.asarray(jax.block_until_ready(fn()))
    assert fast.enable()
    replaced = np.asarray(jax.block_until_ready(fn()))
  finally:
    (fast.enable if was_installed else fast.uninstall)()
  return original, replaced


def _assert_bit_identical(original: np.ndarray, replaced: np.ndarray) -> None:
  assert original.dtype == replaced.dtype and original.shape == replaced.shape
  assert np.isfinite(original.astype(np.float32)).all()
  np.testing.assert_array_equal(original.view(np.uint8), replaced.view(np.uint8))


@pytest.mark.quick
def test_the_suite_runs_with_the_replacement_on_cpu():
  """conftest installs it for CPU runs; a jax whose function changed would leave it out, and this says so."""
  assert fast.why_not_installable() is None, fast.why_not_installable()
  assert fast.installed() == (os.environ.get("M3JAX_TEST_FAST_INTERPRET", "1") != "0")


def test_sparse_attention_is_bit_identical():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 4, 16, 64), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (2, 300, 1, 64), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (2, 300, 1, 64), jnp.float32).astype(jnp.bfloat16)
  positions = jnp.asarray([[200, 201, 202, 203], [296, 297, 298, 299]], jnp.int32)
  ids = jnp.asarray([[[[0, 1]]] * 4, [[[2, 0]]] * 4], jnp.int32)  # [B, Sq, KV, topk]
  run = lambda: sparse_attention(q, k, v, ids, positions, block_size=128, scale=0.125, interpret=True)
  _assert_bit_identical(*_both_ways(run))


@pytest.mark.quick
def test_indexer_is_bit_identical():
  keys = jax.random.split(jax.random.key(1), 2)
  idx_q = jax.random.normal(keys[0], (1, 4, 4, 128), jnp.float32).astype(jnp.bfloat16)
  idx_k = jax.random.normal(keys[1], (1, 400, 128), jnp.float32).astype(jnp.bfloat16)
  positions = jnp.asarray([[130, 250, 390, 399]], jnp.int32)
  run = lambda: indexer_topk(idx_q, idx_k, positions, block_size=128, topk=2, local_blocks=1, interpret=True)
  original, replaced = _both_ways(run)
  assert (original >= 0).any()
  np.testing.assert_array_equal(original, replaced)


def test_moe_block_is_bit_identical():
  keys = jax.random.split(jax.random.key(2), 7)
  t, h, inter, e = 37, 128, 128, 4
  normal = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale
  args = (normal(keys[0], (t, h), 1.0).astype(jnp.bfloat16), normal(keys[1], (h, e), h ** -0.5),
          normal(keys[2], (e,), 0.1), normal(keys[3], (e, h, 2 * inter), 3 * h ** -0.5).astype(jnp.bfloat16),
          normal(keys[4], (e, inter, h), inter ** -0.5).astype(jnp.bfloat16),
          normal(keys[5], (h, 2 * inter), 3 * h ** -0.5).astype(jnp.bfloat16),
          normal(keys[6], (inter, h), inter ** -0.5).astype(jnp.bfloat16))
  tiles = MoeBlockSizes(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2, wg_split="n")
  run = lambda: moe_block(*args, top_k=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
                          interpret=True, block_sizes=(tiles, tiles))
  _assert_bit_identical(*_both_ways(run))
