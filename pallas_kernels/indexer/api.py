"""Public lightning-indexer op: block scores + token-causal mask + 128-key block max + top-k selection.

Same contract as ``indexer_topk_reference`` (see reference.py); the ids of a row come out in descending
score order in both modes (the contract leaves the order free).

dtypes: bf16/f16 run natively (fp32 accumulation). fp32 inputs run through the same bf16 kernel with a
3-pass split stacked along the head dim ([q_hi, q_hi, q_lo] . [k_hi, k_lo, k_hi], ~1e-5 relative
scores) at 3x the FLOPs and one pipeline stage: a correctness path, not a fast one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._fp32_split import split3_lhs, split3_rhs
from pallas_kernels.indexer.config import (
    ROWS_PER_TILE, SMEM_LIMIT_BYTES, IndexerBlockSizes, heuristic_block_sizes,
)
from pallas_kernels.indexer.kernel_sm90 import KEY_BLOCK, indexer_pallas

MAX_FUSED_TOPK = 32
_NATIVE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_inputs(idx_q, idx_k, q_positions, block_size, topk, local_blocks, init_blocks):
  """ValueError for inconsistent inputs, NotImplementedError for what the kernel does not cover."""
  if idx_q.ndim != 4 or idx_k.ndim != 3:
    raise ValueError(f"idx_q must be [B, Sq, Hi, Di] and idx_k [B, Sk, Di], got {idx_q.shape}, {idx_k.shape}")
  b, sq, _, di = idx_q.shape
  if idx_k.shape[0] != b or idx_k.shape[2] != di:
    raise ValueError(f"idx_k {idx_k.shape} does not match idx_q {idx_q.shape}")
  if q_positions.shape != (b, sq) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
    raise ValueError(f"q_positions must be int [B={b}, Sq={sq}], got {q_positions.dtype}{q_positions.shape}")
  if topk < 1 or local_blocks < 0 or init_blocks < 0:
    raise ValueError(f"need topk >= 1, local_blocks >= 0, init_blocks >= 0; got {topk}, {local_blocks}, {init_blocks}")
  if idx_k.shape[1] == 0:
    raise ValueError("idx_k has no keys")
  if block_size != KEY_BLOCK:
    raise NotImplementedError(f"indexer kernel supports block_size={KEY_BLOCK} only, got {block_size}")
  if di not in (64, 128):
    raise NotImplementedError(f"indexer kernel supports index head dim 64 or 128, got {di}")
  if idx_q.dtype != idx_k.dtype:
    raise NotImplementedError(f"idx_q and idx_k dtypes differ: {idx_q.dtype} vs {idx_k.dtype}")
  if idx_q.dtype not in (*_NATIVE, jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"indexer kernel supports bf16/f16/f32, got {idx_q.dtype}")


def _split_fp32(q_rows, keys):
  """fp32 -> bf16 hi/lo stacked along Di so that one bf16 dot gives qh.kh + qh.kl + ql.kh."""
  return split3_lhs(q_rows, axis=-1), split3_rhs(keys, axis=-1)


def _row_metadata(q_positions, num_heads, num_rows, num_keys, num_blocks):
  """Per-row (limit, qb) int32 [B, R] and per-tile (n_end, n_full) int32 [B, R // 64, 2]."""
  b = q_positions.shape[0]
  pos = jnp.repeat(q_positions.astype(jnp.int32), num_heads, axis=1)
  pos = jnp.pad(pos, [(0, 0), (0, num_rows - pos.shape[1])], constant_values=-1)
  limit = jnp.where(pos >= 0, jnp.minimum(pos, num_keys - 1), -1)
  qb = jnp.floor_divide(pos, KEY_BLOCK)
  tiles_qb = qb.reshape(b, -1, ROWS_PER_TILE)
  n_end = jnp.minimum(tiles_qb.max(-1), num_blocks - 1) + 1
  n_full = jnp.clip((limit.reshape(b, -1, ROWS_PER_TILE).min(-1) + 1) // KEY_BLOCK, 0, n_end)
  return limit, qb, jnp.stack([n_end, n_full], axis=-1).astype(jnp.int32)


def select_blocks_sorted(
    block_scores: jax.Array, q_positions: jax.Array, *, topk: int, local_blocks: int, init_blocks: int
) -> jax.Array:
  """select_blocks_reference's rule (forced local/init blocks, -1 padding) with the top-k as one lax.sort.

  Used for the kernel's block-score mode: XLA:GPU lowers lax.top_k with k <= 16 over >= 1024 entries to
  its __gpu$TopK custom kernel, which took 62 us on a 4 x 1024 decode problem (a sort takes a few us).

  Args:
    block_scores: fp32 [B, Sq, Hi, nb] (NaN = garbage, treated as -1e30 like the reference).
    q_positions: int32 [B, Sq].

  Returns:
    int32 [B, Sq, Hi, topk], left-packed, -1 padded, in descending score order.
  """
  nb = block_scores.shape[-1]
  scores = jnp.where(jnp.isnan(block_scores), -1e30, block_scores)
  qb = jnp.floor_divide(q_positions, KEY_BLOCK)[:, :, None, None]
  blk = jnp.arange(nb, dtype=jnp.int32)
  valid = blk <= qb
  forced = ((blk > qb - local_blocks) | (blk < init_blocks)) & valid
  scores = jnp.where(forced, jnp.inf, jnp.where(valid, scores, -jnp.inf))
  neg, ids = jax.lax.sort((-scores, jnp.broadcast_to(blk, scores.shape)), dimension=3, num_keys=1)
  ids = jnp.where(neg[..., :topk] == jnp.inf, -1, ids[..., :topk])
  return jnp.pad(ids, [(0, 0)] * 3 + [(0, topk - ids.shape[-1])], constant_values=-1)


def _interpret_params(interpret: Any) -> Any:
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or False


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "chunk_size", "interpret", "block_sizes"),
)
def indexer_topk(
    idx_q: jax.Array,
    idx_k: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
    chunk_size: int = 256,
    interpret: Any = False,
    block_sizes: IndexerBlockSizes | None = None,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Lightning-indexer block selection (Mosaic GPU kernel).

  Args:
    idx_q: [B, Sq, Hi, Di] index queries (post-norm, post-RoPE); idx_k: [B, Sk, Di] index keys.
    q_positions: int [B, Sq], each query's position in its own sequence (key slot j = position j).
    block_size: keys per block (128 only). topk, local_blocks, init_blocks: selection parameters.
    chunk_size: accepted for signature parity with the reference; the kernel never materialises
      token-level scores, so it has no memory knob.
    interpret: True (or plgpu.InterpretGPUParams) to run the kernel on CPU in GPU interpret mode.
    block_sizes: optional IndexerBlockSizes; default from heuristic_block_sizes.
    page_table: int32 [B, n] when idx_k is a page pool [P, 128, Di] (pallas_kernels._paging): key block i of
      sequence b is read from pool page page_table[b, i] (Sk = n * 128).

  Returns:
    int32 [B, Sq, Hi, topk]: selected block ids, left-packed, -1 padded.
  """
  del chunk_size
  b, sq, hi, di = idx_q.shape
  if page_table is not None:
    if idx_k.ndim != 3 or idx_k.shape[1] != KEY_BLOCK:
      raise NotImplementedError(f"paged indexer kernel reads a pool [P, {KEY_BLOCK}, Di]; got {idx_k.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
      raise ValueError(f"page_table must be int [B={b}, pages], got {page_table.dtype}{page_table.shape}")
  view = idx_k if page_table is None else jax.ShapeDtypeStruct((b, page_table.shape[1] * KEY_BLOCK, idx_k.shape[2]),
                                                               idx_k.dtype)
  _check_inputs(idx_q, view, q_positions, block_size, topk, local_blocks, init_blocks)
  sk = view.shape[1]
  num_blocks = -(-sk // KEY_BLOCK)
  num_rows = -(-(sq * hi) // ROWS_PER_TILE) * ROWS_PER_TILE
  q_rows = jnp.pad(idx_q.reshape(b, sq * hi, di), [(0, 0), (0, num_rows - sq * hi), (0, 0)])
  keys = idx_k if page_table is None else idx_k.reshape(1, -1, idx_k.shape[2])
  table = None if page_table is None else jnp.maximum(page_table.astype(jnp.int32), 0)
  if sk % KEY_BLOCK:
    keys = jnp.pad(keys, [(0, 0), (0, num_blocks * KEY_BLOCK - sk), (0, 0)])
  if block_sizes is None:
    block_sizes = heuristic_block_sizes(b, num_rows // ROWS_PER_TILE, num_blocks)
  if topk > MAX_FUSED_TOPK and block_sizes.fused_topk:
    block_sizes = IndexerBlockSizes(kv_stages=block_sizes.kv_stages, num_splits=1, fused_topk=False)
  if idx_q.dtype == jnp.float32:
    q_rows, keys = _split_fp32(q_rows, keys)
  while block_sizes.kv_stages > 1 and block_sizes.smem_bytes(q_rows.shape[-1]) > SMEM_LIMIT_BYTES:
    block_sizes = IndexerBlockSizes(
        kv_stages=block_sizes.kv_stages - 1, num_splits=block_sizes.num_splits, fused_topk=block_sizes.fused_topk
    )
  limit, qb, tile_blocks = _row_metadata(q_positions, hi, num_rows, sk, num_blocks)
  out = indexer_pallas(
      q_rows, keys, limit, qb, tile_blocks, num_blocks=num_blocks, topk=topk, local_blocks=local_blocks,
      init_blocks=init_blocks, block_sizes=block_sizes, interpret=_interpret_params(interpret), page_table=table,
  )
  out = jnp.swapaxes(out, 1, 2)[:, : sq * hi].reshape(b, sq, hi, -1)
  if block_sizes.fused_topk:
    return out
  return select_blocks_sorted(
      out, q_positions.astype(jnp.int32), topk=topk, local_blocks=local_blocks, init_blocks=init_blocks
  )
