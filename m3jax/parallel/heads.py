"""Head-parallel (and query-token-parallel) attention and indexer under ``shard_map``.

Attention and the lightning indexer are independent per (sequence, KV group / index head, query), so each
device runs the unsharded op (Pallas kernel or reference) on its batch rows, its heads (``act_heads``) and its
query tokens (``act_q_seq``, sequence parallelism), against the *whole* cached key sequence. Key/value heads
must already be repeated up to the head axis (m3jax.sharding.head_replication), so heads split evenly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from m3jax import logical_axes as ax
from m3jax.sharding import ShardingPlan, current_plan


def _layout(plan: ShardingPlan, batch: int, queries: int, kv_heads: int):
  """(batch, query-token, head) spec entries; the heads entry must divide both q and kv heads."""
  spec = plan.spec((ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_HEADS), (batch, queries, kv_heads))
  return spec[0], spec[1], spec[2]


def _active() -> ShardingPlan | None:
  plan = current_plan()
  return None if plan is None or plan.is_trivial else plan


def plan_active() -> bool:
  """Whether a multi-device sharding plan is active (the ops then run per device under shard_map)."""
  return _active() is not None


def attention(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, block_ids: jax.Array | None,
              q_positions: jax.Array) -> jax.Array:
  """``fn(q, k, v, [block_ids,] q_positions)`` per device.

  q [B,Sq,Nq,D], k/v [B,Sk,Nkv,D], block_ids [B,Sq,Nkv,T] or None, q_positions [B,Sq] -> [B,Sq,Nq,D].
  """
  plan = _active()
  args = (q, k, v) + (() if block_ids is None else (block_ids,)) + (q_positions,)
  if plan is None:
    return fn(*args)
  b, s, h = _layout(plan, q.shape[0], q.shape[1], k.shape[2])
  q_spec, kv_spec = P(b, s, h, None), P(b, None, h, None)
  specs = (q_spec, kv_spec, kv_spec) + (() if block_ids is None else (q_spec,)) + (P(b, s),)
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def indexer(fn: Callable[..., jax.Array], idx_q: jax.Array, idx_k: jax.Array, q_positions: jax.Array) -> jax.Array:
  """``fn(idx_q, idx_k, q_positions)`` per device: idx_q [B,Sq,Hi,Di], idx_k [B,Sk,Di] (one shared key head,
  whole sequence on every device), q_positions [B,Sq] -> int32 block ids [B,Sq,Hi,T]."""
  plan = _active()
  if plan is None:
    return fn(idx_q, idx_k, q_positions)
  b, s, h = _layout(plan, idx_q.shape[0], idx_q.shape[1], idx_q.shape[2])
  q_spec = P(b, s, h, None)
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=(q_spec, P(b, None, None), P(b, s)), out_specs=q_spec,
                       check_vma=False)(idx_q, idx_k, q_positions)
