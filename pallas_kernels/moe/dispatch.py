"""Token permutation for the tile-grouped MoE GEMMs (pure jnp; sort + histogram).

Two layouts. The *grouped* layout (``build_dispatch``; ``M_pad = max_tiles * block_m`` rows):

  [ shared-expert tiles: token t at row t | expert 0 tiles | expert 1 tiles | ... | dead tiles ]

Each expert's rows start on a ``block_m`` boundary, so every tile belongs to one expert and each
touched expert is streamed once per (m-tile, n-tile). Padding rows replay token 0; their outputs
are never read.

The *broadcast* layout (``build_broadcast_dispatch``, decode: T <= block_m): one tile per touched
expert, and every tile's rows are all T tokens (row t = token t), so the GEMM's lhs is simply x padded
to ``block_m`` rows, read by every tile; no per-row gather. The extra rows cost wgmma work only, which is
free while decode streams weights; they are computed from real tokens (finite) and never read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """Routing layout for one batch.

  meta: int32 [1 + max_tiles]: live tile count, then the expert of each tile (E = shared expert).
  row_token: int32 [M_pad], the token whose activations feed each padded row; None in the broadcast
    layout (the rows of every tile are the T tokens).
  pos: int32 [T, K], the padded row holding assignment (t, k) (row 0 for a dropped assignment).
  kept: bool [T, K], False for assignments dropped by ``drop_foreign`` (their pos must not be read).
  shared_tiles: static number of leading tiles that hold the shared expert (0 if not fused).
  """

  meta: jax.Array
  row_token: jax.Array | None
  pos: jax.Array
  kept: jax.Array
  shared_tiles: int


def max_routed_tiles(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
  """Static bound on sum_e ceil(count_e / block_m) over the nonempty experts."""
  assignments = num_tokens * top_k
  nonempty = min(num_experts, assignments)
  return min(assignments, (assignments + nonempty * (block_m - 1)) // block_m)


_ONEHOT_MAX_ASSIGNMENTS = 4096


def _kept(flat: jax.Array, num_experts: int, drop_foreign: bool) -> jax.Array:
  """bool [T*K]: assignments to experts held here ([0, E)); all of them unless drop_foreign."""
  return (flat >= 0) & (flat < num_experts) if drop_foreign else jnp.ones(flat.shape, bool)


def build_dispatch(
    expert_ids: jax.Array, *, num_experts: int, block_m: int, fuse_shared: bool,
    method: str = "auto", drop_foreign: bool = False,
) -> Dispatch:
  """Sorts the [T, K] assignments by expert into block_m-aligned groups.

  Args:
    expert_ids: int32 [T, K] routed expert of each (token, slot).
    num_experts: E.
    block_m: tile rows.
    fuse_shared: prepend ceil(T / block_m) tiles (expert id E) holding every token once.
    method: "sort" (stable argsort), "onehot" (ranks from a [T*K, E] one-hot cumsum: a few fused
      ops and no sort, for decode) or "auto" (onehot up to 4096 assignments).
    drop_foreign: assignments whose id is outside [0, E) are dropped (no row, ``kept`` False): the
      experts held by another device under expert parallelism. Without it, ids must be in [0, E).

  Returns:
    Dispatch.
  """
  t, k = expert_ids.shape
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  kept = _kept(flat, num_experts, drop_foreign)
  if drop_foreign:
    flat = jnp.where(kept, flat, num_experts)  # one id past the experts: sorts last, counted nowhere
  if fuse_shared:
    shared_tiles = -(-t // block_m)
  else:
    shared_tiles = 0
  max_tiles = shared_tiles + max_routed_tiles(t, k, num_experts, block_m)
  m_pad = max_tiles * block_m

  if method == "auto":
    method = "onehot" if t * k <= _ONEHOT_MAX_ASSIGNMENTS else "sort"
  if method == "onehot":
    onehot = (flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    counts = jnp.sum(onehot, axis=0)  # [E]
  else:
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  tiles_e = (counts + block_m - 1) // block_m
  tile_end_e = jnp.cumsum(tiles_e)  # inclusive
  tile_start_e = tile_end_e - tiles_e
  group_start_e = jnp.cumsum(counts) - counts  # start of expert e in the sorted order

  if method == "onehot":  # rank of each assignment among its expert's, in assignment order
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    row = (shared_tiles + tile_start_e[flat]) * block_m + rank  # [T*K], assignment order
    row = jnp.where(kept, row, m_pad)  # dropped: out of bounds, skipped by the scatter below
    src_token = jnp.arange(t * k, dtype=jnp.int32) // k
    pos = jnp.where(kept, row, 0).reshape(t, k)
  elif method == "sort":
    order = jnp.argsort(flat, stable=True)  # sorted slot -> assignment index
    sorted_e = flat[order]
    rank = jnp.arange(t * k, dtype=jnp.int32) - group_start_e[sorted_e]
    row = (shared_tiles + tile_start_e[sorted_e]) * block_m + rank  # [T*K], sorted order
    row = jnp.where(kept[order], row, m_pad)
    src_token = (order // k).astype(jnp.int32)
    pos = jnp.zeros((t * k,), jnp.int32).at[order].set(row)
    pos = jnp.where(kept, pos, 0).reshape(t, k)
  else:
    raise ValueError(f"method must be auto, sort or onehot, got {method!r}")

  row_token = jnp.zeros((m_pad,), jnp.int32)
  if fuse_shared:
    row_token = row_token.at[:t].set(jnp.arange(t, dtype=jnp.int32))
  row_token = row_token.at[row].set(src_token, mode="drop")

  tile_ids = jnp.arange(max_tiles - shared_tiles, dtype=jnp.int32)
  # searchsorted(tile_end_e, tile_ids, side="right") by comparing all pairs: jnp.searchsorted's default
  # binary search is a scan, i.e. a while loop of ~log2(E) tiny launches on GPU.
  routed_expert = jnp.sum(tile_end_e[None, :] <= tile_ids[:, None], axis=1, dtype=jnp.int32)
  routed_expert = jnp.minimum(routed_expert, num_experts - 1)  # dead tiles; never visited
  tile_expert = jnp.concatenate(
      [jnp.full((shared_tiles,), num_experts, jnp.int32), routed_expert]
  )
  num_live = (shared_tiles + tile_end_e[-1]).astype(jnp.int32)
  meta = jnp.concatenate([num_live[None], tile_expert])
  return Dispatch(meta=meta, row_token=row_token, pos=pos, kept=kept.reshape(t, k), shared_tiles=shared_tiles)


def build_broadcast_dispatch(
    expert_ids: jax.Array, *, num_experts: int, block_m: int, fuse_shared: bool, drop_foreign: bool = False,
) -> Dispatch:
  """The broadcast layout (module docstring) for T <= block_m tokens: one tile per touched expert.

  Tiles: [shared tile (if fuse_shared) | touched experts in increasing id | dead tiles], at most
  ``fuse_shared + min(T*K, E)``; assignment (t, k) sits at row ``tile * block_m + t``. Written as
  all-pairs comparisons on tiny arrays (no sort, cumsum or scatter): a few small fusions on GPU.

  Args / Returns: as ``build_dispatch`` (``row_token`` is None).
  """
  t, k = expert_ids.shape
  if t > block_m:
    raise ValueError(f"the broadcast dispatch needs T <= block_m, got T={t}, block_m={block_m}")
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  kept = _kept(flat, num_experts, drop_foreign)
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  touched = jnp.any(kept[:, None] & (flat[:, None] == experts[None, :]), axis=0)  # [E]
  # slot[e]: number of touched experts below e (exclusive prefix count, as an [E, E] masked sum)
  slot = jnp.sum(touched[None, :] & (experts[None, :] < experts[:, None]), axis=1, dtype=jnp.int32)
  shared_tiles = 1 if fuse_shared else 0
  max_routed = min(t * k, num_experts)
  # meta as one [1 + shared_tiles + max_routed, E] masked sum: row 0 counts the live tiles, the shared
  # rows hold E, routed row j holds the touched expert of slot j (0 for dead tiles, never visited).
  j = jnp.arange(1 + shared_tiles + max_routed, dtype=jnp.int32)[:, None]
  ev = experts[None, :]
  first_col = ev == 0
  contrib = jnp.where(
      j == 0, touched[None, :].astype(jnp.int32) + jnp.where(first_col, shared_tiles, 0),
      jnp.where(j <= shared_tiles, jnp.where(first_col, num_experts, 0),
                jnp.where(touched[None, :] & (slot[None, :] == j - 1 - shared_tiles), ev, 0)))
  meta = jnp.sum(contrib, axis=1, dtype=jnp.int32)
  token = jnp.arange(t * k, dtype=jnp.int32) // k
  safe_e = jnp.where(kept, flat, 0)
  pos = jnp.where(kept, (shared_tiles + slot[safe_e]) * block_m + token, 0).reshape(t, k)
  return Dispatch(meta=meta, row_token=None, pos=pos, kept=kept.reshape(t, k), shared_tiles=shared_tiles)
