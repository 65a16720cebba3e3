"""XLA-side work plan for the attention kernel: per (query tile, KV group) block lists and row limits.

A tile is `Q = queries_per_tile` consecutive queries of one sequence. For each tile and KV group the
kernel walks a list of key blocks; for each list entry it also gets a bitmask of the tile's queries
that use that block (bit i = query i of the tile). Rows of the wgmma tile are (query i, head h) with
row = i * heads_per_group + h.

* sparse: the list is the sorted union of the Q queries' selected ids (duplicates and -1 removed); for
  Q = 1 it is the query's own T slots (an empty slot has users = 0, so the kernel masks it).
* dense causal: the list is every block 0 .. last block any query of the tile can see.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.config import KEY_BLOCK, ROWS_PER_TILE

_BIG = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Kernel metadata (all int32).

  blocks: [B, tiles, G, U] key-block ids of each tile's list (entries past `count` are 0).
  users: [B, tiles, G, U] bitmask of the tile's queries that selected each listed block.
  count: [B, tiles, G] list length.
  row_limit: [B, tiles, W * 64] last visible key slot per wgmma row (-1: row sees nothing); W = compute
    warpgroups, warpgroup w owning rows [64 w, 64 w + 64) = the tile's queries [w Q / W, (w + 1) Q / W).
  row_bit: [W * 64] 1 << (query index within the tile) for real rows, 0 for padding rows.
  """

  blocks: jax.Array
  users: jax.Array
  count: jax.Array
  row_limit: jax.Array
  row_bit: jax.Array


def padded_query_count(num_queries: int, queries_per_tile: int) -> int:
  return -(-num_queries // queries_per_tile) * queries_per_tile


def _last_visible_key(q_positions: jax.Array, num_keys: int) -> jax.Array:
  """Last key slot each query sees (its position, clipped to the keys; -1 for padding queries)."""
  return jnp.where(q_positions >= 0, jnp.minimum(q_positions, num_keys - 1), -1)


def _row_metadata(q_positions, num_keys, queries_per_tile, heads_per_group, compute_wgs=1):
  """row_limit [B, tiles, W * 64] and row_bit [W * 64] (see TilePlan)."""
  b, sq_pad = q_positions.shape
  per_wg = queries_per_tile // compute_wgs
  limit = _last_visible_key(q_positions, num_keys)
  per_row = jnp.repeat(limit.reshape(b, -1, compute_wgs, per_wg), heads_per_group, axis=3)
  real_rows = per_wg * heads_per_group
  row_limit = jnp.pad(per_row, [(0, 0), (0, 0), (0, 0), (0, ROWS_PER_TILE - real_rows)], constant_values=-1)
  rows = jnp.arange(ROWS_PER_TILE, dtype=jnp.int32)
  query = jnp.arange(compute_wgs, dtype=jnp.int32)[:, None] * per_wg + rows // heads_per_group
  row_bit = jnp.where(rows < real_rows, jnp.left_shift(1, query), 0)
  return row_limit.reshape(b, -1, compute_wgs * ROWS_PER_TILE).astype(jnp.int32), row_bit.reshape(-1).astype(jnp.int32)


def _union_of_selections(ids):
  """ids int32 [..., Q, T] (-1 = empty) -> (blocks, users, count) over [..., Q*T] (left-packed union).

  Sorting id*Q + query puts each block's users next to each other; a run's bitmask is the difference of
  a running sum of (1 << query) between the run's end and start (queries are distinct within a run).
  """
  q, t = ids.shape[-2:]
  query = jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32)[:, None], (q, t))
  keyed = jnp.where(ids >= 0, ids * q + query, _BIG).reshape(*ids.shape[:-2], q * t)
  keyed = jnp.sort(keyed, axis=-1)
  valid = keyed < _BIG
  block = jnp.where(valid, keyed // q, -1)
  weight = jnp.where(valid, jnp.left_shift(1, keyed % q), 0)
  prev_block = jnp.pad(block[..., :-1], [(0, 0)] * (block.ndim - 1) + [(1, 0)], constant_values=-2)
  next_block = jnp.pad(block[..., 1:], [(0, 0)] * (block.ndim - 1) + [(0, 1)], constant_values=-2)
  run_start = valid & (block != prev_block)
  run_end = valid & (block != next_block)
  running = jnp.cumsum(weight, axis=-1)
  before_run = jax.lax.cummax(jnp.where(run_start, running - weight, 0), axis=block.ndim - 1)
  users = running - before_run
  position = jnp.arange(q * t, dtype=jnp.int32)
  order_key = jnp.where(run_end, position, _BIG)
  _, blocks, users = jax.lax.sort((order_key, jnp.maximum(block, 0), users), dimension=-1, num_keys=1)
  count = run_end.sum(-1).astype(jnp.int32)
  live = position < count[..., None]
  return jnp.where(live, blocks, 0), jnp.where(live, users, 0), count


def sparse_plan(
    block_ids: jax.Array, q_positions: jax.Array, *, num_keys: int, queries_per_tile: int, heads_per_group: int,
    compute_wgs: int = 1,
) -> TilePlan:
  """Plan for block-sparse attention.

  Args:
    block_ids: int32 [B, Sq_pad, G, T] (Sq_pad % queries_per_tile == 0; -1 = empty slot).
    q_positions: int32 [B, Sq_pad] (-1 for padding queries).
    num_keys: real key count Sk (ids >= ceil(Sk / 128) are ignored, like the reference).
    compute_wgs: warpgroups sharing a tile (row layout of row_limit / row_bit).
  """
  b, sq_pad, g, t = block_ids.shape
  q = queries_per_tile
  num_blocks = -(-num_keys // KEY_BLOCK)
  ids = jnp.where((block_ids >= 0) & (block_ids < num_blocks), block_ids, -1).astype(jnp.int32)
  ids = jnp.where(q_positions[:, :, None, None] >= 0, ids, -1)
  ids = jnp.moveaxis(ids.reshape(b, sq_pad // q, q, g, t), 3, 2)  # [B, tiles, G, Q, T]
  if q == 1:  # the query's own list as is: empty slots load block 0 and mask it (no sort for decode)
    blocks = jnp.maximum(ids[..., 0, :], 0)
    users = (ids[..., 0, :] >= 0).astype(jnp.int32)
    count = jnp.full(blocks.shape[:-1], t, jnp.int32)
  else:
    blocks, users, count = _union_of_selections(ids)
  row_limit, row_bit = _row_metadata(q_positions, num_keys, q, heads_per_group, compute_wgs)
  return TilePlan(blocks, users, count, row_limit, row_bit)


def dense_causal_plan(
    q_positions: jax.Array, *, num_keys: int, num_kv_heads: int, queries_per_tile: int, heads_per_group: int,
    compute_wgs: int = 1,
) -> TilePlan:
  """Plan for dense causal attention: every block up to the tile's last visible key; a block's users are
  the tile's queries that see at least one of its keys."""
  b, sq_pad = q_positions.shape
  q = queries_per_tile
  num_blocks = -(-num_keys // KEY_BLOCK)
  row_limit, row_bit = _row_metadata(q_positions, num_keys, q, heads_per_group, compute_wgs)
  last = row_limit.max(-1)  # [B, tiles]
  count = jnp.where(last >= 0, last // KEY_BLOCK + 1, 0).astype(jnp.int32)
  count = jnp.broadcast_to(count[:, :, None], (b, sq_pad // q, num_kv_heads))
  blocks = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32), (*count.shape, num_blocks))
  limit = _last_visible_key(q_positions, num_keys).reshape(b, -1, q)  # [B, tiles, Q]
  sees = limit[:, :, None, :] >= jnp.arange(num_blocks, dtype=jnp.int32)[None, None, :, None] * KEY_BLOCK
  users = jnp.sum(jnp.where(sees, jnp.left_shift(1, jnp.arange(q, dtype=jnp.int32)), 0), axis=-1, dtype=jnp.int32)
  users = jnp.broadcast_to(users[:, :, None, :], blocks.shape)
  return TilePlan(blocks, users, count, row_limit, row_bit)
