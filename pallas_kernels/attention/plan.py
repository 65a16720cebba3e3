"""XLA-side work plan for the attention kernel: per (query tile, KV group) block lists and row limits.

A tile is `Q = queries_per_tile` consecutive queries of one sequence. For each tile and KV group the
kernel walks a list of key blocks; for each list entry it also gets a bitmask of the tile's queries
that use that block (bit i = query i of the tile). Rows of the wgmma tile are (query i, head h) with
row = i * heads_per_group + h.

* sparse: the list is the sorted union of the Q queries' selected ids (duplicates and -1 removed); for
  Q = 1 it is the query's own T slots (an empty slot has users = 0, so the kernel masks it).
* dense causal: the list is every block 0 .. last block any query of the tile can see.

Sparse plans can also regroup queries into tiles (`regrouped_query_order`): per KV group, the queries of
each aligned window of 64 are paired by their selections (pairs, then pairs of pairs, ...) so that a tile
holds queries that share blocks, and its union (the rows the kernel spends) shrinks. The plan then carries
each tile's query indices per KV group (`queries`) and row limits per KV group.
"""

from __future__ import annotations

import dataclasses
import math

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
  queries: None when tile t holds the consecutive queries [t Q, (t + 1) Q); for a regrouped plan, int32
    [B, tiles, G, Q] the query indices of each tile per KV group, and row_limit is then [B, tiles, G, W * 64].
  """

  blocks: jax.Array
  users: jax.Array
  count: jax.Array
  row_limit: jax.Array
  row_bit: jax.Array
  queries: jax.Array | None = None


def padded_query_count(num_queries: int, queries_per_tile: int) -> int:
  return -(-num_queries // queries_per_tile) * queries_per_tile


def _last_visible_key(q_positions: jax.Array, num_keys: int) -> jax.Array:
  """Last key slot each query sees (its position, clipped to the keys; -1 for padding queries)."""
  return jnp.where(q_positions >= 0, jnp.minimum(q_positions, num_keys - 1), -1)


def _row_metadata(q_positions, num_keys, queries_per_tile, heads_per_group, compute_wgs=1):
  """row_limit [*lead, tiles, W * 64] and row_bit [W * 64] (see TilePlan) for q_positions [*lead, Sq_pad]."""
  *lead, sq_pad = q_positions.shape
  per_wg = queries_per_tile // compute_wgs
  limit = _last_visible_key(q_positions, num_keys)
  per_row = jnp.repeat(limit.reshape(*lead, -1, compute_wgs, per_wg), heads_per_group, axis=-1)
  real_rows = per_wg * heads_per_group
  pad = [(0, 0)] * (per_row.ndim - 1) + [(0, ROWS_PER_TILE - real_rows)]
  row_limit = jnp.pad(per_row, pad, constant_values=-1)
  rows = jnp.arange(ROWS_PER_TILE, dtype=jnp.int32)
  query = jnp.arange(compute_wgs, dtype=jnp.int32)[:, None] * per_wg + rows // heads_per_group
  row_bit = jnp.where(rows < real_rows, jnp.left_shift(1, query), 0)
  return (row_limit.reshape(*lead, -1, compute_wgs * ROWS_PER_TILE).astype(jnp.int32),
          row_bit.reshape(-1).astype(jnp.int32))


REGROUP_WINDOW = 64  # queries per regrouping window (aligned): a tile's queries come from one window
_REGROUP_ROUNDS = 8  # mutual-best rounds per pairing level


def _selection_bitsets(ids: jax.Array, num_blocks: int) -> jax.Array:
  """ids int32 [..., T] (-1 = empty, distinct otherwise) -> uint32 [..., ceil(num_blocks / 32)] membership."""
  words = -(-num_blocks // 32)
  valid = ids >= 0
  word = jnp.where(valid, ids >> 5, -1)
  bit = jnp.left_shift(jnp.uint32(1), (jnp.maximum(ids, 0) & 31).astype(jnp.uint32))
  hit = word[..., None, :] == jnp.arange(words, dtype=jnp.int32)[:, None]  # [..., words, T]
  return jax.lax.reduce(jnp.where(hit, bit[..., None, :], jnp.uint32(0)), jnp.uint32(0), jax.lax.bitwise_or,
                        (ids.ndim,))


def _pair_sets(sets: jax.Array, items: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One pairing level: sets uint32 [..., k, words], items int32 [..., k, m] -> ([..., k/2, words], [..., k/2, 2m]).

  The cost of a pair is the size of its union. Rounds of mutual best choices pair the sets whose cheapest
  partner is each other (ties broken by a fixed pseudo-random order of the pairs); the sets left after the
  rounds pair in the order of a hash of their sets. On indexer selections 8 rounds give the unions of 32 (16K prefill). k <= 64.
  """
  k = sets.shape[-2]
  union = jax.lax.population_count(sets[..., :, None, :] | sets[..., None, :, :]).astype(jnp.int32).sum(-1)
  index = jnp.arange(k, dtype=jnp.int32)
  big = jnp.iinfo(jnp.int32).max
  # Union sizes tie often. A symmetric pseudo-random rank per pair (an odd multiplier permutes the pair
  # codes mod 4096) makes every pair's cost distinct without favouring low indices, so each round pairs
  # every pair that is the cheapest for both of its sets: repeated, this is the greedy matching.
  lo, hi = jnp.minimum(index[:, None], index[None, :]), jnp.maximum(index[:, None], index[None, :])
  union = union * 4096 + (((lo * 64 + hi) * 2731 + 1213) & 4095)
  union = jnp.where(index[:, None] == index[None, :], big, union)
  partner = jnp.full(sets.shape[:-1], -1, jnp.int32)
  for _ in range(_REGROUP_ROUNDS):
    free = partner < 0
    cost = jnp.where(free[..., :, None] & free[..., None, :], union, big)
    best = jnp.argmin(cost, axis=-1).astype(jnp.int32)
    mutual = free & (jnp.take_along_axis(best, best, axis=-1) == index) & (cost.min(-1) < big)
    partner = jnp.where(mutual, best, partner)
  # An even number of sets is left: pair them in the order of a hash of their sets (equal sets adjacent).
  left = partner < 0
  multipliers = (2 * jnp.arange(sets.shape[-1], dtype=jnp.uint32) + 1) * jnp.uint32(0x9E3779B1)
  digest = (sets * multipliers).sum(-1, dtype=jnp.uint32) >> 1
  by_rank = jnp.argsort(jnp.where(left, digest, jnp.uint32(0xFFFFFFFF)), axis=-1, stable=True).astype(jnp.int32)
  neighbour = by_rank[..., index ^ 1]  # rank r pairs with rank r ^ 1
  rank = jnp.argsort(by_rank, axis=-1).astype(jnp.int32)
  partner = jnp.where(left, jnp.take_along_axis(neighbour, rank, axis=-1), partner)
  first = jnp.argsort(jnp.where(index < partner, index, big), axis=-1)[..., : k // 2].astype(jnp.int32)
  second = jnp.take_along_axis(partner, first, axis=-1)
  take = lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-2)  # noqa: E731
  return take(sets, first) | take(sets, second), jnp.concatenate([take(items, first), take(items, second)], -1)


def regrouped_query_order(block_ids: jax.Array, *, num_blocks: int, queries_per_tile: int) -> jax.Array:
  """Per KV group, an order of the queries in which consecutive tiles hold queries that share blocks.

  Within each aligned window of REGROUP_WINDOW queries, queries are paired (cost: the size of the pair's
  union of selected blocks), the pairs paired, and so on until sets of queries_per_tile; each set is a
  tile, its first half the first compute warpgroup's queries. Mean 4-query unions on indexer selections
  at 16K (scripts/estimate_tile_regrouping.py): 31.2 -> 27.4 blocks correlated, 50.6 -> 43.5 random.

  Args:
    block_ids: int32 [B, Sq_pad, G, T] (-1 = empty; distinct ids per row), Sq_pad % REGROUP_WINDOW == 0.
    num_blocks: key blocks (ids are < num_blocks).
    queries_per_tile: a power of two dividing REGROUP_WINDOW.

  Returns:
    int32 [B, G, Sq_pad]: entry i is the query placed at slot i (a permutation within each window).
  """
  b, sq_pad, g, t = block_ids.shape
  window = REGROUP_WINDOW
  if sq_pad % window or window % queries_per_tile or queries_per_tile & (queries_per_tile - 1):
    raise ValueError(f"regrouping needs Sq_pad % {window} == 0 and a power-of-two queries_per_tile dividing "
                     f"{window}; got Sq_pad={sq_pad}, queries_per_tile={queries_per_tile}")
  ids = jnp.moveaxis(block_ids, 2, 1).reshape(b, g, sq_pad // window, window, t)
  sets = _selection_bitsets(ids, num_blocks)  # [B, G, windows, 64, words]
  items = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32)[:, None], (*sets.shape[:-1], 1))
  for _ in range(int(math.log2(queries_per_tile))):
    sets, items = _pair_sets(sets, items)
  start = jnp.arange(0, sq_pad, window, dtype=jnp.int32)[:, None, None]
  return (items + start).reshape(b, g, sq_pad)


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
    compute_wgs: int = 1, regroup: bool = False,
) -> TilePlan:
  """Plan for block-sparse attention.

  Args:
    block_ids: int32 [B, Sq_pad, G, T] (Sq_pad % queries_per_tile == 0; -1 = empty slot).
    q_positions: int32 [B, Sq_pad] (-1 for padding queries).
    num_keys: real key count Sk (ids >= ceil(Sk / 128) are ignored, like the reference).
    compute_wgs: warpgroups sharing a tile (row layout of row_limit / row_bit).
    regroup: tiles of queries grouped by shared selections (regrouped_query_order; needs
      Sq_pad % REGROUP_WINDOW == 0) instead of consecutive queries.
  """
  b, sq_pad, g, t = block_ids.shape
  q = queries_per_tile
  num_blocks = -(-num_keys // KEY_BLOCK)
  ids = jnp.where((block_ids >= 0) & (block_ids < num_blocks), block_ids, -1).astype(jnp.int32)
  ids = jnp.where(q_positions[:, :, None, None] >= 0, ids, -1)
  if regroup:
    order = regrouped_query_order(ids, num_blocks=num_blocks, queries_per_tile=q)  # [B, G, Sq_pad]
    ids = jnp.take_along_axis(jnp.moveaxis(ids, 2, 1), order[..., None], axis=2)  # [B, G, Sq_pad, T]
    blocks, users, count = _union_of_selections(jnp.moveaxis(ids.reshape(b, g, sq_pad // q, q, t), 1, 2))
    positions = jnp.take_along_axis(jnp.broadcast_to(q_positions[:, None], order.shape), order, axis=2)
    row_limit, row_bit = _row_metadata(positions, num_keys, q, heads_per_group, compute_wgs)
    queries = jnp.moveaxis(order.reshape(b, g, sq_pad // q, q), 1, 2)
    return TilePlan(blocks, users, count, jnp.moveaxis(row_limit, 1, 2), row_bit, queries)
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
