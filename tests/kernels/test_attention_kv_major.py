"""The KV-major sparse attention kernel (kernel_sm90_kv_major.py, selected by KvMajorBlockSizes) and its plan.

Same references and tolerances as test_attention_kernels.py; the cases stress what is specific to this loop
order: runs of one block's users longer than a work item (split over several CTAs), items that end mid-chunk,
repeated / out-of-range / -1 ids (slots that must not reach the merge), padding queries, and heads per group
that are not a multiple of 8 (zero heads pad each group).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import KvMajorBlockSizes, sparse_attention, sparse_attention_reference
from pallas_kernels.attention.plan_kv_major import (
    ITEM_BATCH, ITEM_BLOCK, ITEM_COUNT, ITEM_GROUP, ITEM_START, kv_major_plan, usable_slots,
)
import kernel_modes
from test_attention_kernels import _assert_close, _qkv, _selection

MODES = kernel_modes.MODES


def _run(mode, q, k, v, ids, positions, chunks_per_item, output_staging="q_buffer", query_chunk=8192,
         query_panel=None, compute_wgs=1):
  kw = dict(block_size=128, scale=q.shape[-1] ** -0.5)
  blocks = KvMajorBlockSizes(chunks_per_item=chunks_per_item, output_staging=output_staging,
                             query_chunk=query_chunk, query_panel=query_panel, compute_wgs=compute_wgs)
  got = sparse_attention(q, k, v, ids, positions, interpret=(mode == "interpret"), block_sizes=blocks, **kw)
  ref = sparse_attention_reference(q, k, v, ids, positions, **kw)
  _assert_close(got, ref, q.dtype)
  return np.asarray(got, np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,output_staging", [(jnp.bfloat16, "q_buffer"), (jnp.float16, "q_buffer"),
                                                  (jnp.bfloat16, "separate_one_store")])
def test_m3_group_chunked_prefill(mode, dtype, output_staging):
  """16 heads per KV group (4 queries per wgmma tile), D = 128, two sequences at offsets crossing a block
  boundary, indexer selections; 1 chunk per item, so a block's users span several CTAs; two passes of 4
  queries per sequence (query_chunk=8 over the batch of 2), with per-query stores and with one store per chunk
  into the (item, chunk) layout that the merge gathers back."""
  positions = jnp.array([[300 + i for i in range(8)], [124 + i for i in range(8)]], jnp.int32)
  q, k, v = _qkv(2, 8, 32, 2, 128, 310, dtype)
  ids = _selection(2, 8, 2, 310, positions, topk=2)
  _run(mode, q, k, v, ids, positions, chunks_per_item=1, query_chunk=8, output_staging=output_staging)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("output_staging,query_chunk,query_panel",
                         [("separate", 8192, None), ("q_buffer", 16, None), ("q_buffer", 8192, 12),
                          ("halves", 8192, None), ("halves", 16, 12), ("registers", 16, 12),
                          ("q_buffer_one_store", 16, 12)],
                         ids=["out_buffer_one_pass", "out_in_q_buffer_3_passes", "panels_of_12", "halves",
                              "halves_3_passes_panels_of_12", "registers_3_passes_panels_of_12",
                              "one_store_3_passes_panels_of_12"])
def test_long_runs_ragged_items_and_bad_ids(mode, output_staging, query_chunk, query_panel):
  """40 queries of a 600-token prefill: block 0 is selected by all of them (a run of 40 users: items of
  2 x 8 queries, the last ending mid-chunk), with -1 slots, a repeated id and an id past the keys (both
  ignored, as in the reference); 8 heads per group (8 queries per tile); a padding query (position -1).
  Both output buffers (a separate one, each chunk's own query buffer); one pass, 3 passes of <= 16
  queries (the last one padded), and one pass in panels of 12 queries (block 0's run split per panel, the
  last panel short)."""
  rng = np.random.default_rng(3)
  pos = np.sort(rng.choice(np.arange(130, 600), 40, replace=False)).astype(np.int32)
  pos[7] = -1
  ids = np.full((1, 40, 2, 4), -1, np.int32)
  ids[0, :, :, 0] = 0
  own = np.maximum(pos, 0) // 128
  ids[0, :, 0, 1] = own
  ids[0, :, 1, 1] = np.where(own > 1, 1, own)
  ids[0, ::3, 0, 2] = 0  # repeats slot 0
  ids[0, 1::3, 1, 3] = 9  # past the 5 key blocks
  q, k, v = _qkv(1, 40, 16, 2, 64, 600, jnp.bfloat16, seed=4)
  got = _run(mode, q, k, v, jnp.asarray(ids), jnp.asarray(pos)[None], chunks_per_item=2,
             output_staging=output_staging, query_chunk=query_chunk, query_panel=query_panel)
  assert (got[0, 7] == 0).all()


def _block_0_and_own_blocks(seed: int) -> tuple[jax.Array, jax.Array]:
  """(positions int32 [1, 38], ids int32 [1, 38, 2, 3]): 38 queries at random positions of a 700-token
  prefill, each selecting block 0 and its own block in both KV groups, every fourth also block 2 in group 1."""
  rng = np.random.default_rng(seed)
  pos = np.sort(rng.choice(np.arange(0, 700), 38, replace=False)).astype(np.int32)
  ids = np.full((1, 38, 2, 3), -1, np.int32)
  ids[0, :, :, 0] = 0
  ids[0, :, :, 1] = pos[:, None] // 128
  ids[0, ::4, 1, 2] = 2
  return jnp.asarray(pos)[None], jnp.asarray(ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("output_staging", ["q_buffer", "separate", "halves", "registers",
                                            "q_buffer_one_store"])
def test_head_dim_128_items_of_several_chunks(mode, output_staging):
  """M3's group shape (16 heads, D = 128: two 64-column output parts with "halves") over 38 queries of a
  700-token prefill, all selecting block 0 plus their own block: runs of up to 38 users in items of 3 chunks
  of 4 queries, so buffers are refilled one or two chunks ahead and items end mid-chunk."""
  pos, ids = _block_0_and_own_blocks(seed=8)
  q, k, v = _qkv(1, 38, 32, 2, 128, 700, jnp.bfloat16, seed=12)
  _run(mode, q, k, v, ids, pos, chunks_per_item=3, output_staging=output_staging)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compute_wgs,output_staging", [(2, "q_buffer"), (3, "q_buffer"), (3, "halves"),
                                                        (3, "q_buffer_one_store"), (2, "separate_one_store")])
def test_warpgroups_share_an_item(mode, compute_wgs, output_staging):
  """W warpgroups per CTA take turns on an item's chunks: runs of up to 38 users of block 0 in items of 5
  chunks of 4 queries (warpgroup 0 of 3 takes chunks 0 and 3, warpgroup 2 only chunk 2), and items of
  fewer chunks than warpgroups (the runs of the queries' own blocks), where some warpgroups have none."""
  pos, ids = _block_0_and_own_blocks(seed=9)
  q, k, v = _qkv(1, 38, 32, 2, 128, 700, jnp.bfloat16, seed=13)
  _run(mode, q, k, v, ids, pos, chunks_per_item=5, output_staging=output_staging, compute_wgs=compute_wgs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq,nkv", [(8, 2), (24, 2)], ids=["4_per_group", "12_per_group"])
def test_heads_per_group_not_a_multiple_of_8(mode, nq, nkv):
  positions = jnp.array([[5, 130, 299, 300]], jnp.int32)
  q, k, v = _qkv(1, 4, nq, nkv, 64, 301, jnp.bfloat16, seed=2)
  ids = _selection(1, 4, nkv, 301, positions, topk=2)
  _run(mode, q, k, v, ids, positions, chunks_per_item=4)


def test_shared_memory_over_an_sm_is_refused_before_launch():
  """Four warpgroups each with its own output buffer (264 KB at D = 128) do not fit an SM: a clear error naming
  the knobs, not a failed compile on the GPU. The measured configurations fit (215 KB for the default)."""
  from pallas_kernels.attention.config import SMEM_LIMIT_BYTES, kv_major_block_sizes

  assert kv_major_block_sizes(16).smem_bytes(128) <= SMEM_LIMIT_BYTES
  assert KvMajorBlockSizes(compute_wgs=4).smem_bytes(128) <= SMEM_LIMIT_BYTES  # 4 x "q_buffer" ran (H100)
  positions = jnp.array([[5, 130, 299, 300]], jnp.int32)
  q, k, v = _qkv(1, 4, 32, 2, 128, 301, jnp.bfloat16, seed=2)
  ids = _selection(1, 4, 2, 301, positions, topk=2)
  with pytest.raises(ValueError, match="compute_wgs=4.*shared memory for head dim 128.*fewer warpgroups"):
    sparse_attention(q, k, v, ids, positions, block_size=128, scale=0.125, interpret=True,
                     block_sizes=KvMajorBlockSizes(output_staging="separate_one_store", compute_wgs=4))


def test_registers_staging_needs_heads_per_group_dividing_64():
  """24 heads per group: the wgmma tile holds 2 queries (48 of its 64 rows), so its rows are not whole
  [24, D] slabs of a partial buffer laid out by 64-row chunks: a clear error, not a wrong gather."""
  positions = jnp.array([[5, 130, 299, 300]], jnp.int32)
  q, k, v = _qkv(1, 4, 48, 2, 64, 301, jnp.bfloat16, seed=2)
  ids = _selection(1, 4, 2, 301, positions, topk=2)
  with pytest.raises(ValueError, match="registers.*heads per group dividing 64, got 24"):
    sparse_attention(q, k, v, ids, positions, block_size=128, scale=0.125, interpret=True,
                     block_sizes=KvMajorBlockSizes(output_staging="registers"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.quick
def test_short_sequence_and_rows_without_selections(mode):
  """A 20-token prefill (one partial block) and a row whose slots are all -1: zeros, like the reference."""
  positions = jnp.arange(20, dtype=jnp.int32)[None]
  q, k, v = _qkv(1, 20, 16, 2, 64, 20, jnp.bfloat16, seed=6)
  ids = jnp.zeros((1, 20, 2, 2), jnp.int32).at[:, :, :, 1].set(-1).at[0, 5].set(-1)
  got = _run(mode, q, k, v, ids, positions, chunks_per_item=8)
  assert (got[0, 5] == 0).all()


@pytest.mark.parametrize("query_panel", [None, 50, 16, 1])
@pytest.mark.quick
def test_plan_covers_every_pair_once(query_panel):
  """Every usable (query, group, slot) is in exactly one item, of the item's batch / group / block; items
  hold at most chunks_per_item x Qc pairs, queries ascending, all of one query panel; the real items come
  first, ordered by (batch, group, panel, block); the rest of the items are empty."""
  rng = np.random.default_rng(0)
  b, sq, g, t, sk = 2, 50, 3, 5, 900
  ids = rng.integers(-1, 9, (b, sq, g, t)).astype(np.int32)
  pos = rng.integers(-1, 900, (b, sq)).astype(np.int32)
  plan = jax.tree.map(np.asarray, kv_major_plan(jnp.asarray(ids), jnp.asarray(pos), num_keys=sk,
                                                heads_per_group=16, chunks_per_item=2, query_panel=query_panel))
  panel = sq if query_panel is None else query_panel
  valid = np.asarray(usable_slots(jnp.asarray(ids), jnp.asarray(pos), sk))
  seen = np.zeros_like(valid, np.int32)
  items = plan.items
  assert (items[:, ITEM_COUNT] <= 8).all() and items[:, ITEM_COUNT].sum() == valid.sum()
  real = np.flatnonzero(items[:, ITEM_COUNT] > 0)
  np.testing.assert_array_equal(real, np.arange(len(real)))
  order_keys = []
  for n in real:
    it = items[n]
    sl = slice(it[ITEM_START], it[ITEM_START] + it[ITEM_COUNT])
    queries, slots = plan.pair_query[sl], plan.pair_slot[sl]
    assert (np.diff(queries) > 0).all()
    assert len(set(queries // panel)) == 1, "an item mixes query panels"
    order_keys.append((it[ITEM_BATCH], it[ITEM_GROUP], queries[0] // panel, it[ITEM_BLOCK], queries[0]))
    assert (ids[it[ITEM_BATCH], queries, it[ITEM_GROUP], slots] == it[ITEM_BLOCK]).all()
    np.add.at(seen, (it[ITEM_BATCH], queries, it[ITEM_GROUP], slots), 1)
    # item n's j-th pair writes slab n * C * Qc + j of a partial buffer laid out by (item, chunk)
    np.testing.assert_array_equal(plan.pair_slab[it[ITEM_BATCH], queries, it[ITEM_GROUP], slots],
                                  n * 2 * 4 + np.arange(len(queries)))
    limits = plan.chunk_limit[n].reshape(-1, 16)  # [C * Qc queries, 16 rows each]
    want = np.minimum(pos[it[ITEM_BATCH], queries], sk - 1)
    assert (limits[: len(queries)] == want[:, None]).all() and (limits[len(queries):] == -1).all()
  assert order_keys == sorted(order_keys)
  np.testing.assert_array_equal(seen, valid.astype(np.int32))
  np.testing.assert_array_equal(plan.valid, valid)
  assert (plan.pair_slab[~valid] == 0).all()


def test_prefers_kv_major_compares_block_loads_with_pairs():
  from pallas_kernels.attention.api import KV_MAJOR_LOAD_RATIO, prefers_kv_major

  pairs = jnp.ones((1, 100, 2, 8), bool)  # 1600 selected pairs
  assert not prefers_kv_major(jnp.full((1, 10, 2), 32), pairs)  # 640 loads: 0.40, not above the ratio
  assert prefers_kv_major(jnp.full((1, 10, 2), 33), pairs)  # 660 loads: 0.4125
  assert KV_MAJOR_LOAD_RATIO == 0.40


@pytest.mark.interpret
@kernel_modes.CPU_ONLY
@pytest.mark.parametrize("shared", [True, False], ids=["shared_selections", "private_selections"])
def test_either_loop_order_by_selection_overlap(shared):
  """The compiled prefill's choice between the two kernels (run here in interpret mode): 16 queries at
  positions 1030.. of a 1100-token cache (9 blocks), two 8-query tiles, 2 KV groups, top-2. Shared: every
  query selects blocks 0 and 8 (a tile's union is 2 blocks: loads / pairs = 2 / 16, query-major); private:
  query i selects blocks i % 8 and 8 (union 9: 9 / 16 > 0.40, KV-major). Both against the reference."""
  from pallas_kernels.attention import SparseAttentionBlockSizes
  from pallas_kernels.attention.api import _sparse_prefill_either_order, prefers_kv_major
  from pallas_kernels.attention.plan import sparse_plan

  positions = jnp.arange(1030, 1046, dtype=jnp.int32)[None]
  first = np.zeros(16, np.int32) if shared else np.arange(16, dtype=np.int32) % 8
  ids = np.stack([first, np.full(16, 8, np.int32)], -1)
  ids = jnp.asarray(np.broadcast_to(ids[None, :, None, :], (1, 16, 2, 2)))
  q, k, v = _qkv(1, 16, 32, 2, 64, 1100, jnp.bfloat16, seed=9)
  plan = sparse_plan(ids, positions, num_keys=1100, queries_per_tile=8, heads_per_group=16, compute_wgs=2)
  assert bool(prefers_kv_major(plan.count, ids >= 0)) == (not shared)
  blocks = SparseAttentionBlockSizes(queries_per_tile=8, kv_stages=2, compute_wgs=2, ping_pong="off")
  got = _sparse_prefill_either_order(q, k, v, ids, positions, scale=0.125, block_sizes=blocks, interpret=True)
  ref = sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=0.125)
  _assert_close(got, ref, jnp.bfloat16)


@kernel_modes.NEEDS_SM90
@pytest.mark.parametrize("shared", [True, False], ids=["shared_selections", "private_selections"])
def test_default_prefill_runs_either_kernel_gpu(shared):
  """sparse_attention's default on a compiled prefill big enough for the warp-specialized kernel (1056
  queries x 2 KV groups = 264 tiles): shared selections (blocks 0 and the query's own: a tile's union is 2
  blocks for 16 pairs) stay query-major; private ones (query i selects only block i % (own + 1): up to 8
  blocks for a tile's 8 pairs, loads / pairs 0.58) go KV-major; both match the reference."""
  from pallas_kernels.attention.api import prefers_kv_major
  from pallas_kernels.attention.plan import sparse_plan

  s = 1056
  positions = jnp.arange(s, dtype=jnp.int32)[None]
  own = np.arange(s) // 128
  if shared:
    ids = np.stack([np.where(own > 0, 0, -1), own], -1).astype(np.int32)  # block 0 is the own block: one slot
  else:
    ids = np.stack([np.arange(s) % (own + 1), np.full(s, -1)], -1).astype(np.int32)
  ids = jnp.asarray(np.broadcast_to(ids[None, :, None, :], (1, s, 2, 2)))
  plan = sparse_plan(ids, positions, num_keys=s, queries_per_tile=8, heads_per_group=16, compute_wgs=2)
  assert bool(prefers_kv_major(plan.count, ids >= 0)) == (not shared)
  q, k, v = _qkv(1, s, 32, 2, 128, s, jnp.bfloat16, seed=11)
  got = sparse_attention(q, k, v, ids, positions, block_size=128, scale=128 ** -0.5)
  _assert_close(got, sparse_attention_reference(q, k, v, ids, positions, block_size=128, scale=128 ** -0.5),
                jnp.bfloat16)
