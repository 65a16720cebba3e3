"""XLA-side work plan for the KV-major sparse attention kernel (kernel_sm90_kv_major.py).

The selections of a prefill are a set of (query, KV group, selected block) pairs. Sorting the pairs by
(sequence, group, query panel, block) makes each block's users within a panel of query_panel consecutive
queries consecutive; each such run is cut into work items of at most chunks_per_item x Qc pairs
(Qc = 64 // heads_per_group queries per wgmma tile), one CTA each. A CTA loads its block's K and V once and
walks its item's pairs Qc at a time. Panels trade K/V reuse for query reuse: CTAs that run at the same time
gather the queries of one panel (whose Q rows then stay in L2) instead of users spread over the sequence.

Pairs are the (query, slot) entries of block_ids that hold a block the query can use: in range, not -1, not a
repeat of an earlier slot of the same row, of a real (position >= 0) query. Each writes the partial output of
its slot; `valid` tells the merge which slots were written.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.config import KEY_BLOCK, ROWS_PER_TILE

_BIG = jnp.iinfo(jnp.int32).max

# Columns of KvMajorPlan.items.
ITEM_BATCH, ITEM_GROUP, ITEM_BLOCK, ITEM_START, ITEM_COUNT = range(5)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvMajorPlan:
  """Kernel metadata (all int32 but `valid`).

  items: [N, 5] per work item (batch, group, block, first pair, pair count); items past the real ones
    have count 0 (the kernel skips them). N is a static bound: ceil(P / (C Qc)) + min(P, B G panels nb).
  pair_query, pair_slot: [P] the query index (in its sequence) and selection slot of each pair, sorted by
    (batch, group, query panel, block, query); entries past the real pairs are 0.
  chunk_limit: [N, C, 64] last visible key slot of each wgmma row of each query chunk of each item
    (row r = query r // heads_per_group of the chunk); -1 for rows past the item's pairs.
  valid: bool [B, Sq_pad, G, T] the (query, slot) entries that are pairs.
  pair_slab: [B, Sq_pad, G, T] where each pair's partial output lies when items write their chunks whole
    (the output stagings of config.CHUNK_LAYOUT_STAGINGS): item i's pair j is slab i * C * Qc + j of the
    [N * C * Qc, hpg, D] partial buffer; 0 where valid is False.
  """

  items: jax.Array
  pair_query: jax.Array
  pair_slot: jax.Array
  chunk_limit: jax.Array
  valid: jax.Array
  pair_slab: jax.Array


def queries_per_chunk(heads_per_group: int) -> int:
  return max(1, ROWS_PER_TILE // heads_per_group)


def usable_slots(block_ids: jax.Array, q_positions: jax.Array, num_keys: int) -> jax.Array:
  """bool [B, Sq, G, T]: slots holding an in-range block id not repeated earlier in the row, of a real query."""
  num_blocks = -(-num_keys // KEY_BLOCK)
  ids = block_ids
  ok = (ids >= 0) & (ids < num_blocks) & (q_positions[:, :, None, None] >= 0)
  t = ids.shape[-1]
  earlier = jnp.tril(jnp.ones((t, t), bool), k=-1)  # [j, j'] = j' < j
  repeat = jnp.any((ids[..., :, None] == ids[..., None, :]) & ok[..., None, :] & earlier, axis=-1)
  return ok & ~repeat


def kv_major_plan(
    block_ids: jax.Array, q_positions: jax.Array, *, num_keys: int, heads_per_group: int, chunks_per_item: int,
    query_panel: int | None = None,
) -> KvMajorPlan:
  """Plan for the KV-major kernel.

  Args:
    block_ids: int32 [B, Sq_pad, G, T] (-1 = empty slot).
    q_positions: int32 [B, Sq_pad] (-1 for padding queries).
    num_keys: real key count Sk (ids >= ceil(Sk / 128) are ignored, like the reference).
    heads_per_group: wgmma rows per query (a multiple of 8, <= 64).
    chunks_per_item: query chunks per work item.
    query_panel: queries (of one sequence) per panel; None: one panel.
  """
  b, sq, g, t = block_ids.shape
  qc = queries_per_chunk(heads_per_group)
  per_item = qc * chunks_per_item
  num_blocks = -(-num_keys // KEY_BLOCK)
  block_ids = block_ids.astype(jnp.int32)
  valid = usable_slots(block_ids, q_positions, num_keys)
  p = b * sq * g * t
  batch = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
  group = jnp.arange(g, dtype=jnp.int32)[None, None, :, None]
  panel_size = sq if query_panel is None else min(query_panel, sq)
  panels = -(-sq // panel_size)
  if b * g * panels * num_blocks >= _BIG:
    raise ValueError(f"KV-major plan: {b} x {g} x {panels} panels x {num_blocks} blocks overflows int32 run keys")
  panel = (jnp.arange(sq, dtype=jnp.int32) // panel_size)[None, :, None, None]
  run_key = jnp.where(valid, ((batch * g + group) * panels + panel) * num_blocks + block_ids, _BIG).reshape(p)
  flat = jnp.arange(p, dtype=jnp.int32)
  key, order = jax.lax.sort((run_key, flat), num_keys=1, is_stable=True)  # stable: queries ascend within a run
  live = key < _BIG
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), key[:-1]])
  run_first = jax.lax.cummax(jnp.where(live & (key != prev), flat, 0), axis=0)
  starts = live & ((flat - run_first) % per_item == 0)
  item_of = jnp.cumsum(starts.astype(jnp.int32)) - 1
  n = -(-p // per_item) + min(p, b * g * panels * num_blocks)
  into = jnp.where(starts, item_of, n)
  first = jnp.zeros((n,), jnp.int32).at[into].set(flat, mode="drop")
  item_key = jnp.zeros((n,), jnp.int32).at[into].set(key, mode="drop")
  count = jnp.zeros((n,), jnp.int32).at[jnp.where(live, item_of, n)].add(1, mode="drop")
  items = jnp.stack(
      [item_key // (g * panels * num_blocks), (item_key // (panels * num_blocks)) % g, item_key % num_blocks,
       first, count], axis=-1)

  query = jnp.where(live, (order // (g * t)) % sq, 0)
  slot = jnp.where(live, order % t, 0)
  last_key = jnp.minimum(q_positions, num_keys - 1).astype(jnp.int32)  # [B, Sq]; padding never forms a pair
  pair_limit = last_key.reshape(-1)[jnp.where(live, order // (sq * g * t), 0) * sq + query]
  rows = jnp.arange(ROWS_PER_TILE, dtype=jnp.int32)
  pos_in_item = jnp.arange(chunks_per_item, dtype=jnp.int32)[:, None] * qc + rows[None, :] // heads_per_group
  real_row = (rows < qc * heads_per_group)[None, None, :] & (pos_in_item[None] < count[:, None, None])
  chunk_limit = jnp.where(real_row, pair_limit[jnp.minimum(first[:, None, None] + pos_in_item[None], p - 1)], -1)
  slab = jnp.where(live, item_of * per_item + flat - first[jnp.clip(item_of, 0, n - 1)], 0)
  pair_slab = jnp.zeros((p,), jnp.int32).at[order].set(slab).reshape(b, sq, g, t)
  return KvMajorPlan(items.astype(jnp.int32), query, slot, chunk_limit.astype(jnp.int32), valid, pair_slab)
