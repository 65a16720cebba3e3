"""The compiled sparse prefill's loop orders (loop_order.py, api._sparse_prefill_by_cost): the sharing counts
and cost model that choose between them, the query-major kernel's merge of other partial outputs that the
split order relies on, and each order (forced, and as chosen) against the reference."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import SparseAttentionBlockSizes, sparse_attention, sparse_attention_reference
from pallas_kernels.attention import loop_order
from pallas_kernels.attention.api import _sparse_prefill_by_cost
from pallas_kernels.attention.config import LSE_COLUMNS
from pallas_kernels.attention.plan import sparse_plan
from pallas_kernels.attention.plan_kv_major import usable_slots
import kernel_modes
from test_attention_kernels import _assert_close, _qkv

_TWO_WGS = SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2, ping_pong="off")


def _usable_ids(ids, positions, num_keys):
  usable = usable_slots(ids, positions, num_keys)
  return jnp.where(usable, ids, -1), usable


def _brute_force_sharing(ids, usable, qpt, qpw):
  """(tile users, warpgroup users) per slot by Python loops over queries: numpy int [B, Sq, G, T]."""
  ids, usable = np.asarray(ids), np.asarray(usable)
  b, sq, g, t = ids.shape
  tile, wg = np.zeros(ids.shape, int), np.zeros(ids.shape, int)
  for bi, qi, gi, j in itertools.product(range(b), range(sq), range(g), range(t)):
    if not usable[bi, qi, gi, j]:
      continue
    block = ids[bi, qi, gi, j]

    def users(first, n, block=block):
      return sum(block in set(ids[bi, o, gi][usable[bi, o, gi]]) for o in range(first, first + n))

    tile[bi, qi, gi, j] = users(qi // qpt * qpt, qpt)
    wg[bi, qi, gi, j] = users(qi // qpw * qpw, qpw)
  return tile, wg


def test_slot_sharing_counts_users_of_each_slots_block():
  """Random selections with -1 slots, repeated ids, ids past the keys and a padding query: each usable slot
  counts the queries of its 8-query tile and of its 4-query warpgroup that selected its block; others 0."""
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(-1, 7, size=(2, 16, 2, 4)), jnp.int32)  # 6 blocks (700 keys): id 6 is out
  positions = jnp.asarray(np.where(np.arange(16) == 13, -1, 690 - np.arange(16)), jnp.int32)[None].repeat(2, 0)
  ids, usable = _usable_ids(ids, positions, 700)
  sharing = loop_order.slot_sharing(ids, usable, 8, 2)
  tile, wg = _brute_force_sharing(ids, usable, 8, 4)
  np.testing.assert_array_equal(sharing.tile_users, tile)
  np.testing.assert_array_equal(sharing.warpgroup_users, wg)
  assert (tile[np.asarray(usable)] >= 1).all() and (wg <= tile).all() and (wg > 1).any() and (tile > wg).any()
  np.testing.assert_array_equal(loop_order.shared_slots(sharing), wg >= loop_order.MIN_WARPGROUP_USERS)


def _list_lengths(ids, keep, qpt):
  """Sum over (batch, group, query set of qpt queries) of the distinct kept ids: numpy brute force."""
  ids, keep = np.asarray(ids), np.asarray(keep)
  b, sq, g, _ = ids.shape
  return sum(len(set(ids[bi, q0:q0 + qpt, gi][keep[bi, q0:q0 + qpt, gi]]))
             for bi in range(b) for gi in range(g) for q0 in range(0, sq, qpt))


def test_order_costs_count_loads_warpgroups_and_pairs():
  """Each term of the cost model alone (one unit cost 1, the others 0) equals its count done by brute force:
  the tiles' list entries, the warpgroups' computed entries, the pairs, and the split order's share of each."""
  rng = np.random.default_rng(5)
  ids = jnp.asarray(rng.integers(-1, 6, size=(1, 24, 2, 3)), jnp.int32)
  positions = jnp.arange(700, 724, dtype=jnp.int32)[None]
  ids, usable = _usable_ids(ids, positions, 768)
  sharing = loop_order.slot_sharing(ids, usable, 8, 2)
  shared = np.asarray(loop_order.shared_slots(sharing))
  usable = np.asarray(usable)
  zero = dict(load_ns=0.0, warpgroup_ns=0.0, fixed_ns=0.0, pair_ns=0.0, kv_fixed_ns=0.0, extra_partial_ns=0.0)

  def costs(**unit):
    return np.asarray(loop_order.order_costs(ids, sharing, 8, loop_order.PrefillCostModel(**{**zero, **unit})))

  np.testing.assert_allclose(costs(load_ns=1.0), [_list_lengths(ids, usable, 8), _list_lengths(ids, shared, 8), 0],
                             rtol=1e-5)
  np.testing.assert_allclose(costs(warpgroup_ns=1.0),
                             [_list_lengths(ids, usable, 4), _list_lengths(ids, shared, 4), 0], rtol=1e-5)
  np.testing.assert_allclose(costs(pair_ns=1.0), [0, (usable & ~shared).sum(), usable.sum()])
  np.testing.assert_allclose(costs(extra_partial_ns=1.0), [0, 24 * 2, 0])
  np.testing.assert_allclose(costs(fixed_ns=1.0, kv_fixed_ns=10.0), [1, 11, 10])
  assert 0 < (usable & ~shared).sum() < usable.sum()


@pytest.mark.parametrize("kind,expected", [("shared", loop_order.QUERY_MAJOR), ("private", loop_order.KV_MAJOR),
                                           ("mixed", loop_order.SPLIT)])
def test_choose_order_follows_selection_overlap(kind, expected):
  """64 queries at positions 4000.. (32 blocks of keys), one KV group. shared: every query selects the same 8
  blocks (a tile's list is 8 entries for 64 pairs); private: the 8 queries of a tile select 4 blocks each, all
  different (32 entries for 32 pairs); mixed: 2 blocks per tile shared by all, 2 of each query's own. Per-unit
  costs of the default model without the fixed costs: query-major, KV-major and split win in turn."""
  rng = np.random.default_rng(0)
  ids = np.zeros((64, 8), np.int32) - 1
  for tile in range(8):
    rows = slice(8 * tile, 8 * tile + 8)
    perm = rng.permutation(32)
    if kind == "shared":
      ids[rows] = perm[:8]
    elif kind == "private":
      ids[rows, :4] = perm.reshape(8, 4)
    else:
      ids[rows, :2] = perm[:2]
      ids[rows, 2:4] = perm[2:18].reshape(8, 2)
  ids = jnp.asarray(ids[None, :, None])
  positions = jnp.arange(4000, 4064, dtype=jnp.int32)[None]
  ids, usable = _usable_ids(ids, positions, 4096)
  model = loop_order.PrefillCostModel(fixed_ns=0.0, kv_fixed_ns=0.0)
  costs = loop_order.order_costs(ids, loop_order.slot_sharing(ids, usable, 8, 2), 8, model)
  assert int(loop_order.choose_order(costs)) == expected, costs


def test_choose_order_breaks_ties_to_the_lower_order():
  assert int(loop_order.choose_order(jnp.array([2.0, 1.0, 1.0]))) == loop_order.SPLIT
  assert int(loop_order.choose_order(jnp.array([1.0, 1.0, 1.0]))) == loop_order.QUERY_MAJOR


def _mixed_selection() -> tuple[jax.Array, jax.Array]:
  """14 queries at positions 1030.. of a 1100-token cache (9 blocks; two 8-query tiles, the second with 2
  padding queries), 2 KV groups, top-3. Group 0, tile 0: queries 0-2 share blocks 0 and 8 (shared pairs) and
  have a block of their own (private); query 3 has only a private block; query 5 only shared ones; query 6
  nothing; query 7 repeats block 6 (one pair) and shares block 8 with 4-5. Tile 1 (queries 8-13): a private
  block i % 8 each and block 8 shared. Group 1: the same rows in reverse query order."""
  rows = [[0, 8, 1], [0, 8, 2], [0, -1, 3], [5, -1, -1], [0, 8, 4], [0, 8, -1], [-1, -1, -1], [6, 6, 8]]
  rows += [[i % 8, 8, -1] for i in range(8, 14)]
  group0 = np.asarray(rows, np.int32)
  ids = np.stack([group0, group0[::-1]], axis=1)[None]
  return jnp.asarray(ids), jnp.arange(1030, 1044, dtype=jnp.int32)[None]


def _numpy_partial(q, k, v, qi, g, block, position, scale):
  """The attention of query qi's heads of group g over one key block up to its position, as a partial output:
  (o [16, D] normalised, lse [16] base 2), by numpy in fp32."""
  keys = np.arange(block * 128, min(block * 128 + 128, position + 1))
  heads = slice(16 * g, 16 * g + 16)
  s = np.asarray(q[0, qi, heads], np.float32) @ np.asarray(k[0, keys, g], np.float32).T * scale
  top = s.max(-1, keepdims=True)
  p = np.exp(s - top)
  o = p @ np.asarray(v[0, keys, g], np.float32) / p.sum(-1, keepdims=True)
  return o, (top[:, 0] + np.log(p.sum(-1))) * np.log2(np.e)


@pytest.mark.interpret
@kernel_modes.CPU_ONLY
def test_query_major_kernel_merges_partials():
  """The warp-specialized kernel with PartialsToMerge: it attends each query's shared blocks (slots 0-1 of
  _mixed_selection) and folds in partial outputs of its other blocks (slot 2), computed here by numpy and laid
  out as slabs in a shuffled order with unused slabs between them; a query with no partial, one with partials
  only, and warpgroups whose queries have different partial counts. Equals the reference over all slots."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels.attention.kernel_sm90_ws import PartialsToMerge, ws_attention_pallas

  ids, positions = _mixed_selection()
  ids = jnp.pad(ids, [(0, 0), (0, 2), (0, 0), (0, 0)], constant_values=-1)
  positions = jnp.pad(positions, [(0, 0), (0, 2)], constant_values=-1)
  ids, usable = _usable_ids(ids, positions, 1100)
  q, k, v = _qkv(1, 16, 32, 2, 64, 1152, jnp.bfloat16, seed=4)
  ids_np = np.asarray(ids)
  private = [(qi, g, int(ids_np[0, qi, g, 2])) for qi in range(16) for g in range(2) if ids_np[0, qi, g, 2] >= 0]
  order = np.random.default_rng(0).permutation(len(private)) * 2 + 1  # slab of each partial; even slabs unused
  part_o = np.full((2 * len(private) + 1, 16, 64), 7.0, np.float32)  # unused slabs hold garbage
  part_lse = np.full((2 * len(private) + 1, 16), 50.0, np.float32)
  slabs, count = np.zeros((1, 16, 2, 3), np.int32), np.zeros((1, 16, 2), np.int32)
  for (qi, g, block), slab in zip(private, order):
    part_o[slab], part_lse[slab] = _numpy_partial(q, k, v, qi, g, block, int(positions[0, qi]), 0.125)
    slabs[0, qi, g, count[0, qi, g]] = slab
    count[0, qi, g] += 1
  shared_ids = ids.at[..., 2].set(-1)
  plan = sparse_plan(shared_ids, positions, num_keys=1100, queries_per_tile=8, heads_per_group=16, compute_wgs=2)
  lse_rows = np.repeat(part_lse.reshape(-1, 1), LSE_COLUMNS, axis=1)
  partials = PartialsToMerge(jnp.asarray(part_o.reshape(-1, 64), jnp.bfloat16), jnp.asarray(lse_rows),
                             jnp.asarray(slabs), jnp.asarray(count))
  assert sorted(set(count[0].reshape(-1).tolist())) == [0, 1]
  o, _ = ws_attention_pallas(q, k, v, plan, scale=0.125, block_sizes=_TWO_WGS, check_users=True,
                             interpret=plgpu.InterpretGPUParams(), partials=partials)
  ref = sparse_attention_reference(q[:, :14], k[:, :1100], v[:, :1100], ids[:, :14], positions[:, :14],
                                   block_size=128, scale=0.125)
  _assert_close(o[0, 0, :14], ref[0], jnp.bfloat16)
  assert (np.asarray(o[0, 0, 14:]) == 0).all()


def test_partials_must_match_the_launch():
  from pallas_kernels.attention.kernel_sm90_ws import PartialsToMerge, ws_attention_pallas

  ids, positions = _mixed_selection()
  q, k, v = _qkv(1, 16, 32, 2, 64, 1152, jnp.bfloat16)
  positions = jnp.pad(positions, [(0, 0), (0, 2)], constant_values=-1)
  plan = sparse_plan(jnp.pad(ids, [(0, 0), (0, 2), (0, 0), (0, 0)], constant_values=-1), positions, num_keys=1100,
                     queries_per_tile=8, heads_per_group=16, compute_wgs=2)
  bad = PartialsToMerge(jnp.zeros((32, 64), jnp.bfloat16), jnp.zeros((32, LSE_COLUMNS)),
                        jnp.zeros((1, 14, 2, 3), jnp.int32), jnp.zeros((1, 16, 2), jnp.int32))
  with pytest.raises(ValueError, match="partials do not match"):
    ws_attention_pallas(q, k, v, plan, scale=0.125, block_sizes=_TWO_WGS, check_users=True, partials=bad)


@pytest.mark.interpret
@kernel_modes.CPU_ONLY
@pytest.mark.parametrize("order", [None, loop_order.QUERY_MAJOR, loop_order.SPLIT, loop_order.KV_MAJOR],
                         ids=["by_cost", "query_major", "split", "kv_major"])
def test_each_loop_order_matches_the_reference(order):
  """The compiled prefill's three loop orders (interpret mode here) on _mixed_selection, where the split order
  has shared and private pairs, queries with only one kind or none, and padding queries."""
  ids, positions = _mixed_selection()
  usable = usable_slots(ids, positions, 1100)
  shared = loop_order.shared_slots(loop_order.slot_sharing(
      jnp.pad(jnp.where(usable, ids, -1), [(0, 0), (0, 2), (0, 0), (0, 0)], constant_values=-1),
      jnp.pad(usable, [(0, 0), (0, 2), (0, 0), (0, 0)]), 8, 2))[:, :14]
  assert 0 < int((shared & usable).sum()) < int(usable.sum())
  q, k, v = _qkv(1, 14, 32, 2, 64, 1100, jnp.bfloat16, seed=9)
  got = _sparse_prefill_by_cost(q, k, v, ids, positions, scale=0.125, block_sizes=_TWO_WGS, interpret=True,
                                order=order)
  ref = sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=0.125)
  _assert_close(got, ref, jnp.bfloat16)
  assert (np.asarray(got[0, 6, :16]) == 0).all()  # query 6 selects nothing in group 0


def test_prefill_orders_need_the_warp_specialized_kernel():
  ids, positions = _mixed_selection()
  q, k, v = _qkv(1, 14, 32, 2, 64, 1100, jnp.bfloat16)
  with pytest.raises(ValueError, match="warp-specialized"):
    _sparse_prefill_by_cost(q, k, v, ids, positions, scale=0.125,
                            block_sizes=SparseAttentionBlockSizes(queries_per_tile=4), interpret=True)


@kernel_modes.NEEDS_SM90
@pytest.mark.parametrize("order", [loop_order.QUERY_MAJOR, loop_order.SPLIT, loop_order.KV_MAJOR],
                         ids=["query_major", "split", "kv_major"])
def test_each_loop_order_compiled_gpu(order):
  """Each loop order compiled, on a 1056-query prefill (2 KV groups, top-4) where a query selects block 0, its
  own block, one block its warpgroup shares and one of its own: every order has work."""
  s = 1056
  positions = jnp.arange(s, dtype=jnp.int32)[None]
  own = np.arange(s) // 128
  wg_block = (np.arange(s) // 4) % np.maximum(own, 1)
  mine = np.arange(s) % np.maximum(own, 1)
  ids = np.stack([np.zeros(s), own, wg_block, mine], -1).astype(np.int32)
  ids = np.where(own[:, None] > 0, ids, np.array([0, -1, -1, -1]))  # the first block: block 0 only
  ids = jnp.asarray(np.broadcast_to(ids[None, :, None, :], (1, s, 2, 4)))
  q, k, v = _qkv(1, s, 32, 2, 128, s, jnp.bfloat16, seed=11)
  got = jax.jit(lambda *a: _sparse_prefill_by_cost(*a, scale=128 ** -0.5, block_sizes=_TWO_WGS, order=order))(
      q, k, v, ids, positions)
  _assert_close(got, sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=128 ** -0.5),
                jnp.bfloat16)


@kernel_modes.NEEDS_SM90
def test_default_prefill_gpu():
  """sparse_attention's default on a compiled prefill big enough for the warp-specialized kernel, with the loop
  order chosen on the device: random selections of top-4 among the visible blocks."""
  s = 2048
  positions = jnp.arange(s, dtype=jnp.int32)[None]
  rng = np.random.default_rng(1)
  own = np.arange(s) // 128
  ids = np.stack([np.where(np.arange(4) <= o, rng.permutation(max(o + 1, 4))[:4], -1) for o in own])
  ids = jnp.asarray(np.broadcast_to(ids[None, :, None, :], (1, s, 2, 4)).astype(np.int32))
  q, k, v = _qkv(1, s, 32, 2, 128, s, jnp.bfloat16, seed=12)
  got = sparse_attention(q, k, v, ids, positions, block_size=128, scale=128 ** -0.5)
  _assert_close(got, sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=128 ** -0.5),
                jnp.bfloat16)
