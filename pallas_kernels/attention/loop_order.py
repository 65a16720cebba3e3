"""Which loop order a compiled sparse prefill runs, from the selections themselves (decided on the device).

Three ways to run a prefill's selected (query, KV group, block) pairs:

* query-major (kernel_sm90_ws.py): an 8-query tile walks the union of its queries' blocks; each listed block
  costs one K/V load, and each of the tile's two compute warpgroups (4 queries x 16 heads = 64 wgmma rows)
  that has a user of it computes all 64 rows, whichever of its queries selected it;
* KV-major (kernel_sm90_kv_major.py): every pair is a 16-row slice of a wgmma of queries that all selected
  the block, paid for by a Q gather, a partial output and its merge per pair;
* split by sharing: the pairs whose block at least MIN_WARPGROUP_USERS queries of their warpgroup selected
  run query-major (the warpgroup's load and its 64 rows serve several pairs), the others KV-major, and the
  query-major output joins the KV-major partials in the merge as one more partial.

`order_costs` estimates each from counts of the selections with a linear model whose constants were fitted
to measured times (`PrefillCostModel`), and `choose_order` takes the cheapest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

QUERY_MAJOR, SPLIT, KV_MAJOR = 0, 1, 2
ORDER_NAMES = ("query-major", "split by sharing", "KV-major")

# A pair runs query-major in the split order when at least this many queries of its warpgroup selected its
# block. With the fitted costs below, a block that one query of a warpgroup uses costs a load plus 64 rows
# query-major (3.5 + 5.7 ns) against one KV-major pair (4.6 ns); two users already tip it the other way.
MIN_WARPGROUP_USERS = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrefillCostModel:
  """Nanoseconds per unit of work of each loop order (H100, M3 dims: 16 heads per group, D = 128).

  load_ns, warpgroup_ns, fixed_ns: the query-major prefill, fitted to 8 measured prefills at 32K (the
  thirty-first session's locality sweep and the random and correlated indexer selections of
  bench_attention.py, 3.96-12.87 ms) as fixed + load x (blocks of the tiles' unions) + warpgroup x
  (warpgroups computing a listed block); residuals <= 0.1 ms.
  pair_ns, kv_fixed_ns: the KV-major prefill (9.40 ms for 2.04M pairs at 32K, whatever the overlap): per
    selected pair (Q gather, partial output, merge) and fixed (plan).
  extra_partial_ns: the split order's extra merge input per (query, KV group): the query-major output and
    its log-sum-exps, written and read back (4 KB at ~3 TB/s, both ways).
  """

  load_ns: float = 3.48
  warpgroup_ns: float = 5.74
  fixed_ns: float = 0.2e6
  pair_ns: float = 4.4
  kv_fixed_ns: float = 0.4e6
  extra_partial_ns: float = 2.7


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSharing:
  """Per (batch, query, KV group, slot), all int32 [B, Sq_pad, G, T]; 0 where the slot is not a usable pair.

  tile_users: queries of the slot's query tile that selected its block (the tile's union lists it once).
  warpgroup_users: the same among the queries of the slot's warpgroup (queries_per_tile / 2 of them).
  """

  tile_users: jax.Array
  warpgroup_users: jax.Array


def _tile_slots(x: jax.Array, queries_per_tile: int) -> jax.Array:
  """[B, Sq_pad, G, T] -> [B, tiles, G, queries_per_tile * T] (slot s of the last axis: query s // T)."""
  b, sq_pad, g, t = x.shape
  x = x.reshape(b, sq_pad // queries_per_tile, queries_per_tile, g, t)
  return jnp.moveaxis(x, 3, 2).reshape(b, sq_pad // queries_per_tile, g, queries_per_tile * t)


def _untile_slots(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  b, sq_pad, g, t = shape
  x = x.reshape(b, x.shape[1], g, -1, t)
  return jnp.moveaxis(x, 2, 3).reshape(shape)


def _same_block_counts(ids: jax.Array, counted: jax.Array, where: jax.Array | None = None) -> jax.Array:
  """ids, counted [B, tiles, G, S] -> int32 [B, tiles, G, S]: slots of the tile with the same id that are
  `counted` (and, with where [S, S], pass where[slot, other])."""
  same = (ids[..., :, None] == ids[..., None, :]) & counted[..., None, :]
  if where is not None:
    same = same & where
  return jnp.sum(same, axis=-1, dtype=jnp.int32)


def slot_sharing(block_ids: jax.Array, usable: jax.Array, queries_per_tile: int, compute_wgs: int) -> SlotSharing:
  """How many queries of its tile and of its warpgroup share each usable slot's block.

  Args:
    block_ids: int32 [B, Sq_pad, G, T], Sq_pad % queries_per_tile == 0.
    usable: bool [B, Sq_pad, G, T] (plan_kv_major.usable_slots: in range, not repeated, real query).
    queries_per_tile, compute_wgs: the query-major kernel's tile (8 and 2 for M3).
  """
  t = block_ids.shape[-1]
  ids = _tile_slots(block_ids, queries_per_tile)
  ok = _tile_slots(usable, queries_per_tile)
  slot_wg = jnp.arange(queries_per_tile * t) // t // (queries_per_tile // compute_wgs)
  same_wg = slot_wg[:, None] == slot_wg[None, :]
  tile = jnp.where(ok, _same_block_counts(ids, ok), 0)
  wg = jnp.where(ok, _same_block_counts(ids, ok, same_wg), 0)
  return SlotSharing(_untile_slots(tile, block_ids.shape), _untile_slots(wg, block_ids.shape))


def shared_slots(sharing: SlotSharing) -> jax.Array:
  """bool [B, Sq_pad, G, T]: the pairs the split order runs query-major."""
  return sharing.warpgroup_users >= MIN_WARPGROUP_USERS


def order_costs(block_ids: jax.Array, sharing: SlotSharing, queries_per_tile: int,
                model: PrefillCostModel = PrefillCostModel()) -> jax.Array:
  """fp32 [3]: estimated ns of QUERY_MAJOR, SPLIT and KV_MAJOR on these selections.

  A tile's block with u users among the tile's queries appears in u slots, so summing 1 / u over the slots
  counts the tile's list entries (K/V loads); 1 / warpgroup users counts the (entry, warpgroup) computations.
  """
  usable = sharing.tile_users > 0
  shared = shared_slots(sharing)
  f32 = jnp.float32

  def per_entry(count, keep):
    return jnp.sum(jnp.where(keep, 1.0 / jnp.maximum(count, 1).astype(f32), 0.0))

  ids = _tile_slots(block_ids, queries_per_tile)
  shared_tiled = _tile_slots(shared, queries_per_tile)
  shared_tile_users = _untile_slots(
      jnp.where(shared_tiled, _same_block_counts(ids, shared_tiled), 0), block_ids.shape)
  pairs = jnp.sum(usable, dtype=f32)
  private = jnp.sum(usable & ~shared, dtype=f32)
  query_groups = f32(block_ids.shape[0] * block_ids.shape[1] * block_ids.shape[2])
  query_major = (model.fixed_ns + model.load_ns * per_entry(sharing.tile_users, usable)
                 + model.warpgroup_ns * per_entry(sharing.warpgroup_users, usable))
  kv_major = model.kv_fixed_ns + model.pair_ns * pairs
  split = (model.fixed_ns + model.load_ns * per_entry(shared_tile_users, shared)
           + model.warpgroup_ns * per_entry(sharing.warpgroup_users, shared)
           + model.kv_fixed_ns + model.pair_ns * private + model.extra_partial_ns * query_groups)
  return jnp.stack([query_major, split, kv_major]).astype(f32)


def choose_order(costs: jax.Array) -> jax.Array:
  """int32 scalar: QUERY_MAJOR, SPLIT or KV_MAJOR, the cheapest of order_costs (ties to the lower index)."""
  return jnp.argmin(costs).astype(jnp.int32)
