"""The attention and indexer kernels' paged read path (K/V and index keys in a pool of 128-token pages, read through
a page table per sequence, m3jax.cache.PagedLayerCache) against the references, which gather the pages into rows.

Each case scatters contiguous caches into shuffled pages of a larger pool (other pages hold noise), leaves a
sequence without a page past its end (-1), and checks the kernel (Mosaic GPU interpreter on the CPU) against the
paged reference and the paged reference against the contiguous one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import (
    SparseAttentionBlockSizes, causal_attention, causal_attention_reference, sparse_attention,
    sparse_attention_reference,
)
from pallas_kernels.indexer import IndexerBlockSizes, indexer_topk, indexer_topk_reference
import kernel_modes

MODES = kernel_modes.MODES
PAGE = 128
_REL_TOL = 1e-2  # bf16 (as the contiguous kernel tests)


def _paged(rows: jax.Array, lengths: list[int], num_pages: int, seed: int) -> tuple[jax.Array, jax.Array]:
  """rows [B, n * 128, ...] -> (pool [num_pages, 128, ...] holding each row's pages at shuffled places, noise
  elsewhere; page_table int32 [B, n], -1 for pages wholly past a row's length)."""
  b, s = rows.shape[:2]
  n = s // PAGE
  rng = np.random.default_rng(seed)
  places = rng.permutation(num_pages)[: b * n].reshape(b, n)
  pool = np.array(jax.random.normal(jax.random.key(seed + 7), (num_pages, PAGE, *rows.shape[2:]), jnp.float32))
  table = np.full((b, n), -1, np.int32)
  host = np.asarray(rows, np.float32)
  for r in range(b):
    for i in range(-(-lengths[r] // PAGE)):
      pool[places[r, i]] = host[r, i * PAGE:(i + 1) * PAGE]
      table[r, i] = places[r, i]
  return jnp.asarray(pool, rows.dtype), jnp.asarray(table)


def _assert_close(got, ref):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(got).all()
  rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
  assert rel < _REL_TOL, rel
  np.testing.assert_allclose(got, ref, atol=8 * _REL_TOL, rtol=0)


def _qkv(b, sq, nq, nkv, d, sk, seed):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  shape = (b, sk, nkv, d)
  return (jax.random.normal(kq, (b, sq, nq, d), jnp.float32).astype(jnp.bfloat16),
          jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16),
          jax.random.normal(kv, shape, jnp.float32).astype(jnp.bfloat16))


def _sparse_paged_case(mode, positions, lengths, *, sq, topk, block_sizes=None, seed=0):
  b, nq, nkv, d, sk = len(lengths), 16, 2, 64, 3 * PAGE
  q, k, v = _qkv(b, sq, nq, nkv, d, sk, seed)
  kq, kk = jax.random.split(jax.random.key(seed + 1))
  ids = indexer_topk_reference(jax.random.normal(kq, (b, sq, nkv, 64)), jax.random.normal(kk, (b, sk, 64)),
                               positions, block_size=PAGE, topk=topk, local_blocks=1)
  k_pool, table = _paged(k, lengths, 8, seed)
  v_pool, _ = _paged(v, lengths, 8, seed)
  kw = dict(block_size=PAGE, scale=d ** -0.5)
  ref = sparse_attention_reference(q, k_pool, v_pool, ids, positions, page_table=table, **kw)
  _assert_close(ref, sparse_attention_reference(q, k, v, ids, positions, **kw))  # the pages are the rows
  got = sparse_attention(q, k_pool, v_pool, ids, positions, page_table=table, interpret=(mode == "interpret"),
                         block_sizes=block_sizes, **kw)
  _assert_close(got, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick
def test_paged_sparse_decode(mode):
  """Decode rows at 300 and 130 tokens (the second has no third page), top-2 blocks."""
  positions = jnp.array([[299], [129]], jnp.int32)
  _sparse_paged_case(mode, positions, [300, 130], sq=1, topk=2)


@pytest.mark.parametrize("mode", MODES)
def test_paged_sparse_chunk_four_queries_per_tile(mode):
  """A prefill chunk at an offset (the engine's chunked prefill) over the union of four queries' blocks."""
  positions = jnp.asarray([np.arange(250, 258), np.arange(120, 128)], jnp.int32)
  _sparse_paged_case(mode, positions, [258, 128], sq=8, topk=2,
                     block_sizes=SparseAttentionBlockSizes(queries_per_tile=4), seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_paged_sparse_two_compute_warpgroups(mode):
  """The warp-specialized kernel (8-query tiles over two compute warpgroups) through a page table."""
  positions = jnp.asarray([np.arange(370, 378), np.arange(200, 208)], jnp.int32)
  _sparse_paged_case(mode, positions, [378, 208], sq=8, topk=3,
                     block_sizes=SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2), seed=2)


@pytest.mark.parametrize("mode", MODES)
def test_paged_causal_decode_and_chunk(mode):
  """Dense causal (the full-attention layers): rows at their own lengths, three queries each."""
  q, k, v = _qkv(2, 3, 16, 2, 64, 3 * PAGE, seed=4)
  positions = jnp.array([[100, 101, 102], [380, 381, 382]], jnp.int32)
  k_pool, table = _paged(k, [103, 383], 7, 4)
  v_pool, _ = _paged(v, [103, 383], 7, 4)
  ref = causal_attention_reference(q, k_pool, v_pool, positions, scale=0.1, page_table=table)
  _assert_close(ref, causal_attention_reference(q, k, v, positions, scale=0.1))
  got = causal_attention(q, k_pool, v_pool, positions, scale=0.1, page_table=table, interpret=(mode == "interpret"))
  _assert_close(got, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "block_scores"])
def test_paged_indexer(mode, fused):
  """The indexer's block selection over paged index keys: decode rows at 300 and 200 tokens (well separated block
  maxima, so the kernel's selection equals the reference's)."""
  kq, kk, kb = jax.random.split(jax.random.key(5), 3)
  b, sk, di = 2, 3 * PAGE, 64
  idx_q = jax.random.normal(kq, (b, 2, 4, di), jnp.float32).astype(jnp.bfloat16)
  block_vec = 2.0 * jax.random.normal(kb, (b, 3, di), jnp.float32)
  idx_k = (0.25 * jax.random.normal(kk, (b, sk, di)) + jnp.repeat(block_vec, PAGE, axis=1)).astype(jnp.bfloat16)
  positions = jnp.array([[298, 299], [198, 199]], jnp.int32)
  pool, table = _paged(idx_k[..., None, :], [300, 200], 7, 5)
  pool = pool[:, :, 0]
  kw = dict(block_size=PAGE, topk=2, local_blocks=1)
  ref = indexer_topk_reference(idx_q, pool, positions, page_table=table, **kw)
  np.testing.assert_array_equal(ref, indexer_topk_reference(idx_q, idx_k, positions, **kw))
  bs = IndexerBlockSizes(kv_stages=2, num_splits=1 if fused else 2, fused_topk=fused)
  got = indexer_topk(idx_q, pool, positions, page_table=table, interpret=(mode == "interpret"), block_sizes=bs, **kw)
  np.testing.assert_array_equal(np.sort(np.asarray(got), -1), np.sort(np.asarray(ref), -1))


def test_paged_kernels_refuse_what_they_do_not_cover():
  q, k, v = _qkv(1, 1, 16, 2, 64, 2 * PAGE, seed=6)
  table = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(NotImplementedError, match=r"reads pools \[P, 128, Nkv, D\]"):
    causal_attention(q, k[0].reshape(4, 64, 2, 64), v[0].reshape(4, 64, 2, 64), jnp.zeros((1, 1), jnp.int32),
                     scale=0.1, page_table=table, interpret=True)
  with pytest.raises(ValueError, match=r"page_table must be int \[B=1, pages\]"):
    causal_attention(q, k[0].reshape(2, PAGE, 2, 64), v[0].reshape(2, PAGE, 2, 64), jnp.zeros((1, 1), jnp.int32),
                     scale=0.1, page_table=jnp.zeros((2, 2), jnp.int32), interpret=True)
