"""Lightning-indexer kernel for Hopper (Pallas Mosaic GPU, one warpgroup per CTA).

One CTA owns a tile of 64 index-query rows (row = (query, index head), so 16 queries x 4 heads for
M3) of one sequence and streams that sequence's idx_k in 128-key blocks through a TMA pipeline:

  S = Q_tile[64, Di] . K_blk[128, Di]^T            (wgmma, fp32 accumulation)
  S = where(key_slot <= row_limit, S, -inf)          (only on blocks that cross some row's limit)
  block_score[row] = max over the 128 keys of S      (token scores never leave registers)

and then either
  * fused top-k (prefill): inserts block_score into a per-row sorted top-k kept in registers, with
    forced local/init blocks scored +inf, and writes int32 block ids [B, T, R] at the end; or
  * block scores (decode / split-K): writes fp32 block_score rows to [B, nb, R] (one 64-float TMA
    store per block); the selection then runs as lax.top_k outside.

Per-row inputs (prepared by the api): row_limit = last visible key slot (min(position, Sk - 1); -1
for padding rows), row_qb = position // 128 (the query's own block; -1 for padding rows), and per
tile (n_end, n_full): blocks [0, n_end) hold a visible key for some row, blocks [0, n_full) are
fully visible to every row (no mask needed).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.indexer.config import ROWS_PER_TILE, IndexerBlockSizes

KEY_BLOCK = 128
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


def _smem_transforms(dtype) -> tuple[Any, ...]:
  swizzle = 128
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _row_vector(value, dtype):
  return plgpu.layout_cast(jnp.full((ROWS_PER_TILE,), value, dtype=dtype), _ROW_LAYOUT)


def _insert_sorted(vals: tuple, ids: tuple, x, x_id):
  """Inserts (x, x_id) per row into the descending lists vals/ids (length T); drops the smallest."""
  new_vals, new_ids = [], []
  for v, i in zip(vals, ids):
    take = x > v
    new_vals.append(jnp.where(take, x, v))
    new_ids.append(jnp.where(take, x_id, i))
    x, x_id = jnp.where(take, v, x), jnp.where(take, i, x_id)
  return tuple(new_vals), tuple(new_ids)


def _block_max(q_smem, k_smem, block, row_limit, *, masked: bool):
  """Row max over one 128-key block: [64] fp32 in the WGMMA row layout."""

  def scope(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
    return acc_ref[...]

  scores = pl.run_scoped(scope, plgpu.ACC((ROWS_PER_TILE, KEY_BLOCK), jnp.float32))
  if masked:
    key_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS_PER_TILE, KEY_BLOCK), 1, layout=plgpu.Layout.WGMMA)
    rel_limit = row_limit - block * KEY_BLOCK
    visible = key_ids <= lax.broadcast_in_dim(rel_limit, (ROWS_PER_TILE, KEY_BLOCK), [0])
    scores = jnp.where(visible, scores, -jnp.inf)
  return scores.max(axis=1)


def _indexer_kernel(
    q_ref, k_ref, limit_ref, qb_ref, tile_blocks_ref, *refs, num_tiles: int, blocks_per_split: int, stages: int,
    topk: int, local_blocks: int, init_blocks: int, fused_topk: bool, head_dim: int, paged: bool = False,
):
  """Refs (gmem unless noted):

  q_ref [B, R, Di]; k_ref [B, Sk_pad, Di]; limit_ref, qb_ref int32 [B, R];
  tile_blocks_ref int32 [B, num_tiles, 2] = (n_end, n_full);
  paged: then table_ref int32 [B, nb] follows (the pool block of each logical block) and k_ref is the page pool
  [1, P * 128, Di];
  out_ref: int32 [B, T, R] (fused_topk) or fp32 [B, nb, R];
  q_smem [64, Di]; limit_smem, qb_smem int32 [64]; ids_smem int32 [T, 64] (fused) or fp32 [2, 64] (scores).
  """
  if paged:
    table_ref, *refs = refs
  out_ref, q_smem, limit_smem, qb_smem, ids_smem, load_barrier = refs
  tile = num_tiles - 1 - lax.axis_index("tile")  # longest (latest) tiles first
  split = lax.axis_index("split")
  batch = lax.axis_index("batch")
  rows = pl.ds(tile * ROWS_PER_TILE, ROWS_PER_TILE)

  plgpu.copy_gmem_to_smem(q_ref.at[batch, rows], q_smem, load_barrier.at[0])
  plgpu.copy_gmem_to_smem(limit_ref.at[batch, rows], limit_smem, load_barrier.at[0])
  plgpu.copy_gmem_to_smem(qb_ref.at[batch, rows], qb_smem, load_barrier.at[0])
  plgpu.barrier_wait(load_barrier.at[0])
  row_limit = plgpu.load(limit_smem, layout=_ROW_LAYOUT)
  row_qb = plgpu.load(qb_smem, layout=_ROW_LAYOUT)

  n_end = tile_blocks_ref[batch, tile, 0]
  n_full = tile_blocks_ref[batch, tile, 1]
  lo = split * blocks_per_split
  hi = jnp.minimum(lo + blocks_per_split, n_end)
  mid = jnp.clip(n_full, lo, hi)  # [lo, mid) unmasked, [mid, hi) masked
  if paged:
    k_index = lambda start: lambda i: (0, table_ref[batch, start + i], 0)
  else:
    k_index = lambda start: lambda i: (batch, start + i, 0)
  k_spec = lambda start: plgpu.BlockSpec(
      (None, KEY_BLOCK, head_dim), k_index(start), transforms=_smem_transforms(k_ref.dtype)
  )

  if fused_topk:

    def topk_body(masked, start, idx, k_smem, carry):
      vals, ids = carry
      block = start + idx[0]
      x = _block_max(q_smem, k_smem, block, row_limit, masked=masked)
      block_ids = row_qb * 0 + block  # the block id as a row vector
      forced = block_ids > row_qb - local_blocks
      if init_blocks:
        forced = forced | (block_ids < init_blocks)
      x = jnp.where(forced & (block_ids <= row_qb), jnp.inf, x)
      return _insert_sorted(vals, ids, x, block_ids)

    carry = (
        tuple(_row_vector(-jnp.inf, jnp.float32) for _ in range(topk)),
        tuple(_row_vector(-1, jnp.int32) for _ in range(topk)),
    )
    for masked, start, stop in ((False, lo, mid), (True, mid, hi)):
      carry = plgpu.emit_pipeline(
          functools.partial(topk_body, masked, start),
          grid=(jnp.maximum(stop - start, 0),),
          in_specs=[k_spec(start)],
          max_concurrent_steps=stages,
          init_carry=carry,
      )(k_ref)
    vals, ids = carry
    for t in range(topk):
      ids_smem[t] = jnp.where(vals[t] == -jnp.inf, -1, ids[t])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ids_smem, out_ref.at[batch, :, rows])
    plgpu.wait_smem_to_gmem(0)
    return

  # Block scores: one 64-float TMA store per block from a 2-slot smem ring (ids_smem is [2, 64] fp32).
  # (The pipeline's own out_specs are avoided: their predicated stores do not run in interpret mode.)
  def scores_body(masked, start, idx, k_smem):
    block = start + idx[0]
    slot = lax.rem(block, 2)
    row_max = _block_max(q_smem, k_smem, block, row_limit, masked=masked)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    ids_smem[slot] = row_max
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ids_smem.at[slot], out_ref.at[batch, block, rows])

  for masked, start, stop in ((False, lo, mid), (True, mid, hi)):
    plgpu.emit_pipeline(
        functools.partial(scores_body, masked, start),
        grid=(jnp.maximum(stop - start, 0),),
        in_specs=[k_spec(start)],
        max_concurrent_steps=stages,
    )(k_ref)
  plgpu.wait_smem_to_gmem(0)


def indexer_pallas(
    q_rows: jax.Array,
    keys: jax.Array,
    row_limit: jax.Array,
    row_qb: jax.Array,
    tile_blocks: jax.Array,
    *,
    num_blocks: int,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    block_sizes: IndexerBlockSizes,
    interpret: Any = False,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Launches the indexer kernel.

  Args:
    q_rows: [B, R, Di] index queries, rows = (query, head), R % 64 == 0.
    keys: [B, Sk_pad, Di] index keys, Sk_pad % 128 == 0.
    row_limit, row_qb: int32 [B, R] (module docstring).
    tile_blocks: int32 [B, R // 64, 2] = (n_end, n_full) per row tile.
    num_blocks: nb = number of 128-key blocks of the real keys.
    topk, local_blocks, init_blocks: selection parameters (fused mode only).
    block_sizes: pipeline depth, split-K and mode.
    interpret: False, or plgpu.InterpretGPUParams to run on CPU.
    page_table: int32 [B, nb] when keys is a page pool [1, P * 128, Di]: logical block i of sequence b is read
      from pool block page_table[b, i] (>= 0).

  Returns:
    int32 [B, T, R] block ids (fused_topk) or fp32 [B, nb, R] block scores (rows of blocks that no
    row of a tile can see are left unwritten).
  """
  batch, num_rows, head_dim = q_rows.shape
  if num_rows % ROWS_PER_TILE:
    raise ValueError(f"{num_rows=} must be a multiple of {ROWS_PER_TILE}")
  if keys.shape[1] % KEY_BLOCK:
    raise ValueError(f"key length {keys.shape[1]} must be a multiple of {KEY_BLOCK}")
  num_tiles = num_rows // ROWS_PER_TILE
  splits = block_sizes.num_splits
  blocks_per_split = math.ceil(num_blocks / splits)
  fused = block_sizes.fused_topk
  if fused:
    out_type = jax.ShapeDtypeStruct((batch, topk, num_rows), jnp.int32)
  else:
    out_type = jax.ShapeDtypeStruct((batch, num_blocks, num_rows), jnp.float32)
  kernel = functools.partial(
      _indexer_kernel, num_tiles=num_tiles, blocks_per_split=blocks_per_split,
      stages=block_sizes.kv_stages, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
      fused_topk=fused, head_dim=head_dim, paged=page_table is not None,
  )
  scratch = [
      plgpu.SMEM((ROWS_PER_TILE, head_dim), q_rows.dtype, transforms=_smem_transforms(q_rows.dtype)),
      plgpu.SMEM((ROWS_PER_TILE,), jnp.int32),
      plgpu.SMEM((ROWS_PER_TILE,), jnp.int32),
      plgpu.SMEM((topk, ROWS_PER_TILE), jnp.int32) if fused else plgpu.SMEM((2, ROWS_PER_TILE), jnp.float32),
      plgpu.Barrier(num_arrivals=3, num_barriers=1),
  ]
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      # The last grid axis is CUDA x (fastest-launched, no 65535 limit): consecutive CTAs are
      # neighbouring row tiles of one sequence, which stream the same idx_k blocks through L2.
      grid=(batch, splits, num_tiles),
      grid_names=("batch", "split", "tile"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=f"m3_indexer_{'topk' if fused else 'scores'}_s{block_sizes.kv_stages}",
  )(q_rows, keys, row_limit, row_qb, tile_blocks, *(() if page_table is None else (page_table,)))
