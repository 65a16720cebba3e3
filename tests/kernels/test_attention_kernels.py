"""pallas_kernels.attention.{sparse_attention, causal_attention} (Mosaic GPU) against the references.

CPU: the kernel runs in the Mosaic-GPU interpreter (``interpret=True``, which also stages P through
shared memory because the interpreter cannot take wgmma's A operand from registers) on shapes with few
CTAs: the interpreter costs ~0.1 s per CTA. On an sm90 GPU (``JAX_PLATFORMS=cuda``) the same cases run
compiled with P in registers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import (
    SparseAttentionBlockSizes, causal_attention, causal_attention_reference, sparse_attention,
    sparse_attention_reference,
)
from pallas_kernels.indexer import indexer_topk_reference
import kernel_modes


MODES = kernel_modes.MODES

# Relative L2 error bound: the output is rounded to the input dtype (bf16: 2^-9, f16: 2^-11) and so is
# P before P.V, as in the reference; the bound leaves ~3x headroom over what is observed.
_REL_TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 3e-3}


def _qkv(b, sq, nq, nkv, d, sk, dtype, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, sq, nq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, sk, nkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, sk, nkv, d), jnp.float32).astype(dtype)
  return q, k, v


def _selection(b, sq, nkv, sk, positions, topk, seed=0):
  """Block ids from the reference indexer on random index projections (left-packed, -1 padded)."""
  kq, kk = jax.random.split(jax.random.key(seed + 100))
  idx_q = jax.random.normal(kq, (b, sq, nkv, 64), jnp.float32)
  idx_k = jax.random.normal(kk, (b, sk, 64), jnp.float32)
  return indexer_topk_reference(idx_q, idx_k, positions, block_size=128, topk=topk, local_blocks=1)


def _assert_close(got, ref, dtype):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(got).all()
  rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
  assert rel < _REL_TOL[jnp.dtype(dtype)], rel
  np.testing.assert_allclose(got, ref, atol=8 * _REL_TOL[jnp.dtype(dtype)], rtol=0)


def _sparse_case(mode, b, sq, nq, nkv, d, sk, positions, topk, dtype=jnp.bfloat16, block_sizes=None, seed=0):
  q, k, v = _qkv(b, sq, nq, nkv, d, sk, dtype, seed)
  ids = _selection(b, sq, nkv, sk, positions, topk, seed)
  scale = d ** -0.5
  got = sparse_attention(
      q, k, v, ids, positions, block_size=128, scale=scale, interpret=(mode == "interpret"),
      block_sizes=block_sizes,
  )
  ref = sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=scale)
  _assert_close(got, ref, dtype)
  return np.asarray(got, np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("queries_per_tile", [4, 1])
def test_sparse_ragged_positions(mode, queries_per_tile):
  """Two sequences, 12 queries each at scattered positions of a 700-token cache, top-2 of <= 6 blocks.

  With 4 queries per tile the CTA walks the union of 4 different selections (per-query masks).
  """
  rng = np.random.default_rng(0)
  positions = jnp.asarray(np.sort(rng.choice(700, (2, 12), replace=False), axis=1), jnp.int32)
  _sparse_case(mode, 2, 12, 16, 2, 64, 700, positions, topk=2,
               block_sizes=SparseAttentionBlockSizes(queries_per_tile=queries_per_tile))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sparse_chunked_prefill_m3_group(mode, dtype):
  """16 heads per KV group (M3), D = 128, 8 queries at an offset crossing a block boundary."""
  positions = jnp.array([[300 + i for i in range(8)], [124 + i for i in range(8)]], jnp.int32)
  _sparse_case(mode, 2, 8, 32, 2, 128, 310, positions, topk=2, dtype=dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick
def test_sparse_decode_split(mode):
  """Decode: one query per row at different lengths (Sk % 128 != 0), flash-decoding split of the list."""
  positions = jnp.array([[5], [700], [999]], jnp.int32)
  _sparse_case(mode, 3, 1, 16, 2, 64, 1000, positions, topk=3,
               block_sizes=SparseAttentionBlockSizes(queries_per_tile=1, num_splits=3))


@pytest.mark.parametrize("mode", MODES)
def test_sparse_short_sequence_and_padding(mode):
  """A 20-token prefill (shorter than one block) plus padded query slots (position -1 -> zeros)."""
  positions = jnp.where(jnp.arange(24) < 20, jnp.arange(24), -1)[None].astype(jnp.int32)
  got = _sparse_case(mode, 1, 24, 16, 2, 64, 20, positions, topk=2)
  assert (got[0, 20:] == 0).all()


_TWO_WGS = SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2)


@pytest.mark.parametrize("mode", MODES)
def test_sparse_two_compute_warpgroups(mode):
  """Warp-specialized kernel (a TMA warpgroup + two compute warpgroups of 4 queries x 16 heads each).

  Tile 0 mixes a late chunk (positions 300..) with early queries (124..), so each warpgroup walks
  entries only the other one uses (skipped); tile 2 is all padding (-1: empty list, zero output);
  the 19 real queries are not a multiple of the 8-query tile.
  """
  pos = np.full((2, 24), -1, np.int32)
  pos[0, :8] = [300, 301, 302, 303, 124, 125, 126, 127]
  pos[0, 8:16] = np.arange(500, 508)
  pos[1, :11] = np.arange(11) * 60
  positions = jnp.asarray(pos)
  got = _sparse_case(mode, 2, 24, 32, 2, 128, 600, positions, topk=3, block_sizes=_TWO_WGS)
  assert (got[0, 16:] == 0).all() and (got[1, 11:] == 0).all()


@kernel_modes.NEEDS_SM90
@pytest.mark.parametrize("ping_pong", ["every", "off"])
def test_sparse_two_compute_warpgroups_ping_pong_modes_gpu(ping_pong):
  """Each ping-pong policy of the warp-specialized kernel on a longer walk (compiled on an sm90 GPU; the
  interpreter always runs without the ping-pong, see kernel_sm90_ws.py): 4 tiles whose two warpgroups'
  unions overlap only partly, so entries used by one warpgroup, by both, and by neither (padding) occur."""
  pos = np.full((1, 32), -1, np.int32)
  pos[0, :30] = np.concatenate([np.arange(1000, 1012), np.arange(200, 206), np.arange(1500, 1512)])
  blocks = dataclasses.replace(_TWO_WGS, ping_pong=ping_pong)
  got = _sparse_case("gpu", 1, 32, 32, 2, 128, 1600, jnp.asarray(pos), topk=4, block_sizes=blocks)
  assert (got[0, 30:] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_causal_two_compute_warpgroups(mode):
  """Dense causal plan on the warp-specialized kernel: a chunk straddling block boundaries (the earlier
  warpgroup skips the last block), rows at different lengths, Sk % 128 != 0."""
  q, k, v = _qkv(2, 10, 16, 1, 128, 400, jnp.bfloat16, seed=5)
  positions = jnp.array([list(range(250, 260)), [5, 6, 7, 8, 390, 391, 392, 393, 394, 395]], jnp.int32)
  got = causal_attention(q, k, v, positions, scale=0.1, interpret=(mode == "interpret"), block_sizes=_TWO_WGS,
                         use_cudnn=False)
  _assert_close(got, causal_attention_reference(q, k, v, positions, scale=0.1), jnp.bfloat16)


@pytest.mark.parametrize("mode", MODES)
def test_causal_decode_and_chunked(mode):
  """Dense causal: decode rows at different lengths, then a chunked-prefill chunk at an offset."""
  q, k, v = _qkv(2, 3, 16, 2, 128, 400, jnp.bfloat16)
  positions = jnp.array([[100, 101, 102], [397, 398, 399]], jnp.int32)
  got = causal_attention(q, k, v, positions, scale=0.1, interpret=(mode == "interpret"))
  _assert_close(got, causal_attention_reference(q, k, v, positions, scale=0.1), jnp.bfloat16)


@pytest.mark.parametrize("mode", MODES)
def test_causal_prefill(mode):
  """Plain prefill (Sq == Sk, arange): cuDNN on a GPU, the Pallas kernel in interpret mode."""
  q, k, v = _qkv(1, 40, 32, 2, 64, 40, jnp.bfloat16, seed=3)
  positions = jnp.arange(40, dtype=jnp.int32)[None]
  got = causal_attention(q, k, v, positions, scale=0.125, interpret=(mode == "interpret"))
  _assert_close(got, causal_attention_reference(q, k, v, positions, scale=0.125), jnp.bfloat16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq,nkv", [(8, 2), (24, 2)], ids=["4_per_group", "12_per_group"])
def test_heads_per_group_not_a_multiple_of_8(mode, nq, nkv):
  """4 heads per KV group (a 16-way tensor-parallel slice of M3) or 12: zero heads pad each group to a
  multiple of 8 for the kernel; the real heads match the references (sparse decode rows and a causal chunk)."""
  positions = jnp.array([[5, 130, 299]], jnp.int32)
  _sparse_case(mode, 1, 3, nq, nkv, 64, 300, positions, topk=2)
  q, k, v = _qkv(1, 3, nq, nkv, 64, 300, jnp.bfloat16, seed=2)
  got = causal_attention(q, k, v, positions, scale=0.125, interpret=(mode == "interpret"))
  _assert_close(got, causal_attention_reference(q, k, v, positions, scale=0.125), jnp.bfloat16)


def test_rejects_unsupported():
  q, k, v = _qkv(1, 4, 16, 2, 64, 256, jnp.bfloat16)
  pos = jnp.arange(4, dtype=jnp.int32)[None]
  ids = jnp.zeros((1, 4, 2, 2), jnp.int32)
  with pytest.raises(NotImplementedError):
    sparse_attention(q, k, v, ids, pos, block_size=64, scale=0.1, interpret=True)
  with pytest.raises(NotImplementedError):
    sparse_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), ids, pos,
                     block_size=128, scale=0.1, interpret=True)
  with pytest.raises(NotImplementedError, match="at most 64 heads per KV group"):
    causal_attention(jnp.tile(q, (1, 1, 9, 1)), k, v, pos, scale=0.1, interpret=True)  # 72 per group
  with pytest.raises(ValueError):
    sparse_attention(q, k, v, ids[:, :, :1], pos, block_size=128, scale=0.1, interpret=True)
  with pytest.raises(ValueError):
    causal_attention(q, k, v[:, :100], pos, scale=0.1, interpret=True)


def test_heuristic_picks_the_warp_specialized_kernel_for_prefill_only():
  from pallas_kernels.attention.config import heuristic_block_sizes

  prefill = heuristic_block_sizes(1, 32768, 4, 16, 256)
  assert (prefill.compute_wgs, prefill.queries_per_tile, prefill.num_splits) == (2, 8, 1)
  assert prefill.ping_pong == "off"  # sparse lists: warpgroups skip different entries
  assert heuristic_block_sizes(1, 32768, 4, 16, 256, sparse=False).ping_pong == "every"  # dense plan
  decode = heuristic_block_sizes(64, 1, 4, 16, 16)
  assert (decode.compute_wgs, decode.queries_per_tile) == (1, 1)
  short = heuristic_block_sizes(1, 100, 4, 16, 16)  # 52 eight-query CTAs < 132 SMs: split lists instead
  assert short.compute_wgs == 1 and short.num_splits > 1
  one = heuristic_block_sizes(1, 1, 4, 16, 16)  # B = 1 decode: a 16-entry list split at most 16 ways
  assert (one.queries_per_tile, one.num_splits) == (1, 16)
  assert heuristic_block_sizes(1, 32768, 4, 16, 256, warp_specialized=False).compute_wgs == 1


@pytest.mark.parametrize("splits", [1, 5, 16, 24])
@pytest.mark.quick
def test_merge_splits_matches_a_log_sum_exp_merge(splits):
  """The split merge (unrolled up to 16 splits, reductions beyond) against a float64 LSE merge, with
  empty splits (lse = -inf) and one row whose splits are all empty (-> zeros)."""
  from pallas_kernels.attention.api import _merge_splits

  rng = np.random.default_rng(splits)
  o = rng.standard_normal((splits, 2, 3, 4, 8)).astype(np.float32)
  lse = (rng.standard_normal((splits, 2, 3, 4)) * 4).astype(np.float32)
  lse[rng.random(lse.shape) < 0.3] = -np.inf
  lse[:, 1, 2, 3] = -np.inf
  got = np.asarray(_merge_splits(jnp.asarray(o), jnp.asarray(lse)))
  w = np.exp2(lse.astype(np.float64) - np.where(np.isfinite(lse.max(0)), lse.max(0), 0.0))
  want = (w[..., None] * o).sum(0) / np.where(w.sum(0) > 0, w.sum(0), 1.0)[..., None]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert (got[1, 2, 3] == 0).all()


def test_decode_splits_never_exceed_the_block_list():
  """B = 1 decode at 32K (4 KV groups, top-16): the kernel's partial outputs have 16 splits, one per
  selected block (a 64-way split left 48 of every 64 CTAs with nothing to load; lowering only)."""
  import re

  q = jnp.zeros((1, 1, 64, 128), jnp.bfloat16)
  k = jnp.zeros((1, 32768, 4, 128), jnp.bfloat16)
  ids = jnp.zeros((1, 1, 4, 16), jnp.int32)
  pos = jnp.full((1, 1), 32767, jnp.int32)
  fn = jax.jit(lambda *a: sparse_attention(*a, block_size=128, scale=0.1, interpret=True))
  text = fn.lower(q, k, k, ids, pos).as_text()
  assert set(re.findall(r"tensor<(\d+)x1x1x64x128xbf16>", text)) == {"1", "16"}
