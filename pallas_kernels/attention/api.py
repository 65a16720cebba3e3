"""Public attention ops: block-sparse GQA (`sparse_attention`) and dense causal GQA (`causal_attention`).

Same signatures and semantics as reference.py (plus `interpret` and tuning arguments). Both run the
query-major block-list kernels (kernel_sm90.py, kernel_sm90_ws.py); causal_attention first tries cuDNN's fused
attention when the queries are a plain prefill (Sq == Sk and q_positions == arange, checked at run time with
lax.cond). sparse_attention's compiled prefill also holds the KV-major kernel (kernel_sm90_kv_major.py) and
runs it instead when the selections are shared too little between adjacent queries (prefers_kv_major,
lax.cond on the device).

dtypes: bf16/f16 (fp32 softmax and accumulation, P rounded to the input dtype before P.V, like the
reference). Other dtypes, block_size != 128, head dim not in {64, 128} or more than 64 heads per KV group
raise NotImplementedError so a caller can fall back to the reference. A group of heads that is not a
multiple of 8 (e.g. 4 on a 16-way tensor-parallel slice of M3) runs with zero query heads padding it to the
next multiple, whose rows are computed and dropped.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.config import KEY_BLOCK, ROWS_PER_TILE, SMEM_LIMIT_BYTES, KvMajorBlockSizes
from pallas_kernels.attention.config import CHUNK_LAYOUT_STAGINGS, SparseAttentionBlockSizes
from pallas_kernels.attention.config import heuristic_block_sizes, kv_major_block_sizes
from pallas_kernels.attention.config import one_warpgroup_queries_per_tile
from pallas_kernels.attention.kernel_sm90 import attention_pallas
from pallas_kernels.attention.kernel_sm90_kv_major import kv_major_attention_pallas
from pallas_kernels.attention.kernel_sm90_ws import ws_attention_pallas
from pallas_kernels.attention.plan import dense_causal_plan, padded_query_count, sparse_plan
from pallas_kernels.attention.plan_kv_major import kv_major_plan, usable_slots

_NATIVE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_qkv(q, k, v, q_positions):
  """ValueError for inconsistent inputs, NotImplementedError for what the kernel does not cover."""
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"q must be [B, Sq, Nq, D] and k, v equal [B, Sk, Nkv, D]; got {q.shape}, {k.shape}, {v.shape}")
  b, sq, nq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or k.shape[1] == 0:
    raise ValueError(f"k/v {k.shape} do not match q {q.shape}")
  if nq % k.shape[2]:
    raise ValueError(f"query heads {nq} must be a multiple of KV heads {k.shape[2]}")
  if q_positions.shape != (b, sq) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
    raise ValueError(f"q_positions must be int [B={b}, Sq={sq}], got {q_positions.dtype}{q_positions.shape}")
  if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _NATIVE:
    raise NotImplementedError(f"attention kernel supports bf16/f16 q/k/v of one dtype, got {q.dtype}/{k.dtype}/{v.dtype}")
  if d not in (64, 128):
    raise NotImplementedError(f"attention kernel supports head dim 64 or 128, got {d}")
  hpg = nq // k.shape[2]
  if hpg > ROWS_PER_TILE:
    raise NotImplementedError(f"attention kernel supports at most {ROWS_PER_TILE} heads per KV group, got {hpg}")


def _kernel_heads_per_group(hpg: int) -> int:
  """Heads per KV group as the kernel runs them: a multiple of 8 (rows of a query in the wgmma tile)."""
  return -(-hpg // 8) * 8


def _pad_heads(q: jax.Array, num_kv_heads: int, hpg_run: int) -> jax.Array:
  """q [B, S, Nkv * hpg, D] -> [B, S, Nkv * hpg_run, D]: zero heads appended to each KV group."""
  b, s, nq, d = q.shape
  hpg = nq // num_kv_heads
  if hpg == hpg_run:
    return q
  q = q.reshape(b, s, num_kv_heads, hpg, d)
  return jnp.pad(q, [(0, 0), (0, 0), (0, 0), (0, hpg_run - hpg), (0, 0)]).reshape(b, s, num_kv_heads * hpg_run, d)


def _interpret_params(interpret: Any) -> Any:
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or False


def _fit_block_sizes(bs: SparseAttentionBlockSizes, hpg: int, head_dim: int) -> SparseAttentionBlockSizes:
  wgs = bs.compute_wgs
  qpt = max(wgs, min(bs.queries_per_tile, wgs * (ROWS_PER_TILE // hpg)) // wgs * wgs)
  stages = bs.kv_stages
  while stages > 1 and SparseAttentionBlockSizes(
      kv_stages=stages, p_in_smem=bs.p_in_smem, compute_wgs=wgs, queries_per_tile=qpt).smem_bytes(head_dim) > SMEM_LIMIT_BYTES:
    stages -= 1
  return SparseAttentionBlockSizes(
      queries_per_tile=qpt, kv_stages=stages, num_splits=bs.num_splits, p_in_smem=bs.p_in_smem, compute_wgs=wgs,
      ping_pong=bs.ping_pong,
  )


def _pad_keys(k, v):
  sk = k.shape[1]
  if sk % KEY_BLOCK == 0:
    return k, v
  pad = [(0, 0), (0, -(-sk // KEY_BLOCK) * KEY_BLOCK - sk), (0, 0), (0, 0)]
  return jnp.pad(k, pad), jnp.pad(v, pad)


_UNROLLED_MERGE_MAX_SPLITS = 16


def _merge_splits(o: jax.Array, lse: jax.Array | None) -> jax.Array:
  """o [S, B, Sq, Nq, D], lse fp32 [S, B, Sq, Nq] (base 2) -> [B, Sq, Nq, D] in o.dtype.

  Up to 16 splits the merge is written out split by split, so that XLA emits one elementwise fusion
  instead of a chain of reductions (each its own launch: 4 launches, ~6 us of a B = 1 decode step).
  """
  if lse is None:
    return o[0]
  if o.shape[0] <= _UNROLLED_MERGE_MAX_SPLITS:
    top = functools.reduce(jnp.maximum, list(lse))
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weights = [jnp.exp2(part - top) for part in lse]
    total = functools.reduce(jnp.add, weights)
    out = functools.reduce(jnp.add, [w[..., None] * part.astype(jnp.float32) for w, part in zip(weights, o)])
    return (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(o.dtype)
  top = lse.max(0)
  weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))
  total = weight.sum(0)
  out = (weight[..., None] * o.astype(jnp.float32)).sum(0) / jnp.where(total > 0, total, 1.0)[..., None]
  return out.astype(o.dtype)


def _check_paged(q, k, v, q_positions, page_table):
  """As _check_qkv for page pools k, v [P, 128, Nkv, D] read through page_table int [B, n]."""
  if k.ndim != 4 or k.shape != v.shape or k.shape[1] != KEY_BLOCK:
    raise NotImplementedError(f"paged attention kernel reads pools [P, {KEY_BLOCK}, Nkv, D]; got {k.shape}, {v.shape}")
  b = q.shape[0]
  if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"page_table must be int [B={b}, pages], got {page_table.dtype}{page_table.shape}")
  _check_qkv(q, jnp.zeros((b, 1, *k.shape[2:]), k.dtype), jnp.zeros((b, 1, *v.shape[2:]), v.dtype), q_positions)


def _page_pools(k, v):
  """Pools [P, 128, Nkv, D] -> [1, P * 128, Nkv, D] (pool block i = page i), the kernels' paged K/V operands."""
  return k.reshape(1, -1, *k.shape[2:]), v.reshape(1, -1, *v.shape[2:])


def _plan_pages(page_table, blocks):
  """page_table [B, n], plan blocks [B, tiles, G, U] (logical, < n) -> the pool page of each entry [B, tiles, G, U]
  (a block the sequence has no page for reads page 0: only keys past its end are there, which it never sees)."""
  table = jnp.broadcast_to(page_table.astype(jnp.int32)[:, None, None, :], (*blocks.shape[:3], page_table.shape[1]))
  return jnp.maximum(jnp.take_along_axis(table, blocks, axis=-1), 0)


def _run_kernel(q, k, v, q_positions, make_plan, list_len, *, scale, block_sizes, check_users, interpret,
                page_table=None):
  """Pads each KV group's heads to a multiple of 8, queries to whole tiles and keys to whole blocks, runs the
  kernel, merges splits, unpads.

  make_plan(positions, sq_pad, queries_per_tile, compute_wgs, heads_per_group) builds the block lists.
  check_users: the plan is sparse (rows are masked by their query's bit of each entry's user mask).
  page_table: int32 [B, n] when k, v are page pools [P, 128, Nkv, D]: the plan's logical blocks are read from
  their pages (the plan is built for n * 128 keys).
  """
  b, sq, nq, d = q.shape
  nkv = k.shape[2]
  hpg = _kernel_heads_per_group(nq // nkv)
  q = _pad_heads(q, nkv, hpg)
  if block_sizes is None:
    block_sizes = heuristic_block_sizes(
        b, sq, k.shape[2], hpg, list_len, warp_specialized=not interpret, sparse=check_users
    )
  block_sizes = _fit_block_sizes(block_sizes, hpg, d)
  sq_pad = padded_query_count(sq, block_sizes.queries_per_tile)
  q = jnp.pad(q, [(0, 0), (0, sq_pad - sq), (0, 0), (0, 0)])
  positions = jnp.pad(q_positions.astype(jnp.int32), [(0, 0), (0, sq_pad - sq)], constant_values=-1)
  plan = make_plan(positions, sq_pad, block_sizes.queries_per_tile, block_sizes.compute_wgs, hpg)
  if page_table is None:
    kp, vp = _pad_keys(k, v)
    pages = None
  else:
    (kp, vp), pages = _page_pools(k, v), _plan_pages(page_table, plan.blocks)
  launch = ws_attention_pallas if block_sizes.compute_wgs == 2 else attention_pallas
  o, lse = launch(
      q, kp, vp, plan, scale=scale, block_sizes=block_sizes,
      check_users=check_users, p_in_smem=block_sizes.p_in_smem,
      interpret=_interpret_params(interpret), pages=pages,
  )
  o = _merge_splits(o, lse)[:, :sq]
  if hpg * nkv == nq:
    return o
  return o.reshape(b, sq, nkv, hpg, d)[:, :, :, : nq // nkv].reshape(b, sq, nq, d)


def _sparse_plan_builder(block_ids, num_keys):
  """make_plan for _run_kernel from block_ids [B, Sq, G, T]: the ids padded with -1 to the padded query count."""

  def make_plan(positions, sq_pad, qpt, wgs, heads_per_group):
    pad = [(0, 0), (0, sq_pad - block_ids.shape[1]), (0, 0), (0, 0)]
    ids = jnp.pad(block_ids.astype(jnp.int32), pad, constant_values=-1)
    return sparse_plan(ids, positions, num_keys=num_keys, queries_per_tile=qpt, heads_per_group=heads_per_group,
                       compute_wgs=wgs)

  return make_plan


def _merge_kv_major(o: jax.Array, lse: jax.Array, valid: jax.Array) -> jax.Array:
  """o [B, Sq, G, T, hpg, D], lse fp32 [B, Sq, G, T, hpg] (base 2), valid bool [B, Sq, G, T] ->
  [B, Sq, G * hpg, D] in o.dtype: each query's partial outputs weighted by softmax(lse) over its written
  slots (unwritten slots hold garbage and are dropped, not multiplied by 0); no slot -> zeros."""
  b, sq, g, t, hpg, d = o.shape
  lse = jnp.where(valid[..., None], lse, -jnp.inf)
  top = lse.max(3, keepdims=True)
  weight = jnp.exp2(lse - jnp.where(top == -jnp.inf, 0.0, top))
  total = weight.sum(3)
  parts = jnp.where(valid[..., None, None], o.astype(jnp.float32), 0.0)
  out = (weight[..., None] * parts).sum(3) / jnp.where(total > 0, total, 1.0)[..., None]
  return out.astype(o.dtype).reshape(b, sq, g * hpg, d)


def _kv_major_pass(q, k, v, block_ids, q_positions, *, scale, block_sizes, interpret):
  """One pass of the KV-major kernel: plan, kernel, merge. q's heads per group already a multiple of 8."""
  hpg = q.shape[2] // k.shape[2]
  plan = kv_major_plan(block_ids, q_positions, num_keys=k.shape[1], heads_per_group=hpg,
                       chunks_per_item=block_sizes.chunks_per_item, query_panel=block_sizes.query_panel)
  kp, vp = _pad_keys(k, v)
  o, lse = kv_major_attention_pallas(q, kp, vp, plan, scale=scale, block_sizes=block_sizes,
                                     interpret=_interpret_params(interpret))
  if block_sizes.output_staging in CHUNK_LAYOUT_STAGINGS:  # partials laid out by (item, chunk): gather the pairs
    o = o.reshape(-1, hpg, o.shape[-1])[plan.pair_slab]
    lse = lse.reshape(-1, hpg)[plan.pair_slab]
  return _merge_kv_major(o, lse, plan.valid)


def _run_kv_major(q, k, v, block_ids, q_positions, *, scale, block_sizes, interpret):
  """KV-major kernel: heads padded to a multiple of 8, queries in passes of at most block_sizes.query_chunk
  (over the batch; padding queries have position -1 and select nothing), unpadded."""
  b, sq, nq, d = q.shape
  nkv = k.shape[2]
  hpg = _kernel_heads_per_group(nq // nkv)
  qh = _pad_heads(q, nkv, hpg)
  block_ids = block_ids.astype(jnp.int32)
  q_positions = q_positions.astype(jnp.int32)
  run = functools.partial(_kv_major_pass, k=k, v=v, scale=scale, block_sizes=block_sizes, interpret=interpret)
  chunk = max(1, block_sizes.query_chunk // b)
  if sq <= chunk:
    o = run(qh, block_ids=block_ids, q_positions=q_positions)
  else:
    passes = -(-sq // chunk)
    pad = passes * chunk - sq

    def split(x, fill):
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
      return jnp.swapaxes(x.reshape(b, passes, chunk, *x.shape[2:]), 0, 1)

    o = jax.lax.map(lambda a: run(a[0], block_ids=a[1], q_positions=a[2]),
                    (split(qh, 0), split(block_ids, -1), split(q_positions, -1)))
    o = jnp.swapaxes(o, 0, 1).reshape(b, passes * chunk, *o.shape[3:])[:, :sq]
  if hpg * nkv == nq:
    return o
  return o.reshape(b, sq, nkv, hpg, d)[:, :, :, : nq // nkv].reshape(b, sq, nq, d)


# The query-major prefill kernel pays per K/V block load (one per entry of each 8-query tile's union list;
# ~11-13 ns each on an H100, L2-bound), the KV-major one per selected (query, group, block) pair (~5.0 ns:
# its Q gather, partial output and merge, HBM-bound). bench_attention.py, M3 dims, H100, 32K and 128K:
# query-major 12.9 / 71.6 ms on random selections (loads / pairs 0.58 / 0.79), 7.8 / 37.7 ms on correlated
# ones (0.30 / 0.37); KV-major (one warpgroup, "q_buffer") 10.3 / 41.8 ms on both: the locality sweep crossed
# over at 7 private blocks per query (0.43). With kv_major_block_sizes (3 warpgroups, "separate_one_store";
# 9.4 ms at 32K whatever the overlap, H100, thirty-first session) it crosses at ~6 (query-major 8.02 ms at 4
# private blocks, loads / pairs 0.32; 10.16 ms at 7, 0.43; interpolated 9.42 ms at ~0.40).
KV_MAJOR_LOAD_RATIO = 0.40


def prefers_kv_major(list_count: jax.Array, pairs: jax.Array) -> jax.Array:
  """bool scalar: the KV-major kernel is expected faster, i.e. the query-major plan's K/V block loads
  (list_count summed: [B, tiles, G] union lengths of its tiles) exceed KV_MAJOR_LOAD_RATIO x the selected
  (query, group, block) pairs."""
  return jnp.sum(list_count, dtype=jnp.float32) > KV_MAJOR_LOAD_RATIO * jnp.sum(pairs, dtype=jnp.float32)


def _sparse_prefill_either_order(q, k, v, block_ids, q_positions, *, scale, block_sizes, interpret=False):
  """A prefill: the query-major warp-specialized kernel (block_sizes), or the KV-major kernel when
  prefers_kv_major says so on these selections (decided on the device, lax.cond). sparse_attention uses it
  compiled; tests call it with interpret=True."""
  b, sq, nq, d = q.shape
  nkv = k.shape[2]
  hpg = _kernel_heads_per_group(nq // nkv)
  block_sizes = _fit_block_sizes(block_sizes, hpg, d)
  qpt = block_sizes.queries_per_tile
  sq_pad = padded_query_count(sq, qpt)
  positions = jnp.pad(q_positions.astype(jnp.int32), [(0, 0), (0, sq_pad - sq)], constant_values=-1)
  plan = _sparse_plan_builder(block_ids, k.shape[1])(positions, sq_pad, qpt, block_sizes.compute_wgs, hpg)
  pairs = usable_slots(block_ids.astype(jnp.int32), q_positions.astype(jnp.int32), k.shape[1])

  def query_major(q, k, v, block_ids, q_positions):
    del block_ids
    return _run_kernel(q, k, v, q_positions, lambda *_: plan, 1, scale=scale, block_sizes=block_sizes,
                       check_users=True, interpret=interpret)

  def kv_major(q, k, v, block_ids, q_positions):
    return _run_kv_major(q, k, v, block_ids, q_positions, scale=scale, block_sizes=kv_major_block_sizes(hpg),
                         interpret=interpret)

  return jax.lax.cond(prefers_kv_major(plan.count, pairs), kv_major, query_major, q, k, v, block_ids, q_positions)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "chunk_size", "interpret", "block_sizes"))
def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_ids: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    scale: float,
    chunk_size: int = 256,
    interpret: Any = False,
    block_sizes: SparseAttentionBlockSizes | KvMajorBlockSizes | None = None,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Block-sparse GQA attention (M3 "MSA" attend step), Mosaic GPU kernel.

  Args:
    q: [B, Sq, Nq, D]; k, v: [B, Sk, Nkv, D] (slot j holds position j).
    block_ids: int32 [B, Sq, Nkv, T] selected key blocks per query and KV group (-1 = empty slot;
      ids must be distinct per row, ids >= ceil(Sk / 128) are ignored).
    q_positions: int32 [B, Sq].
    block_size: keys per block (128 only). scale: softmax scale.
    chunk_size: accepted for signature parity with the reference (no memory knob here).
    interpret: True (or plgpu.InterpretGPUParams) to run the kernel on CPU in GPU interpret mode.
    block_sizes: optional SparseAttentionBlockSizes (query-major kernels) or KvMajorBlockSizes (the KV-major
      kernel, kernel_sm90_kv_major.py). None: heuristic_block_sizes; where that picks the warp-specialized
      prefill kernel (compiled, many queries), the KV-major kernel runs instead on selections that
      adjacent queries share too little (prefers_kv_major, decided on the device).

    page_table: int32 [B, n] when k, v are page pools [P, 128, Nkv, D] (pallas_kernels._paging): block i of
      sequence b is read from pool page page_table[b, i]. Paged calls run the query-major kernels only.

  Returns:
    [B, Sq, Nq, D] in q.dtype.
  """
  del chunk_size
  if block_size != KEY_BLOCK:
    raise NotImplementedError(f"sparse attention kernel supports block_size={KEY_BLOCK} only, got {block_size}")
  if page_table is None:
    _check_qkv(q, k, v, q_positions)
  else:
    _check_paged(q, k, v, q_positions, page_table)
  b, sq, _, _ = q.shape
  if block_ids.ndim != 4 or block_ids.shape[:3] != (b, sq, k.shape[2]):
    raise ValueError(f"block_ids must be [B={b}, Sq={sq}, Nkv={k.shape[2]}, T], got {block_ids.shape}")
  if page_table is not None:
    if isinstance(block_sizes, KvMajorBlockSizes):
      raise NotImplementedError("the KV-major kernel does not read page tables")
    return _paged_sparse(q, k, v, block_ids, q_positions, page_table, scale=scale, block_sizes=block_sizes,
                         interpret=interpret)
  if isinstance(block_sizes, KvMajorBlockSizes):
    return _run_kv_major(q, k, v, block_ids, q_positions, scale=scale, block_sizes=block_sizes, interpret=interpret)
  hpg = _kernel_heads_per_group(q.shape[2] // k.shape[2])
  topk = block_ids.shape[3]

  make_plan = _sparse_plan_builder(block_ids, k.shape[1])
  # Longest block list of a tile, for the heuristic's split count (splits only run on the one-warpgroup
  # kernel): its tiles' queries, topk blocks each.
  queries_per_tile = block_sizes.queries_per_tile if block_sizes else one_warpgroup_queries_per_tile(hpg, sq)
  list_len = min(topk * queries_per_tile, -(-k.shape[1] // KEY_BLOCK))
  if block_sizes is None and not interpret:
    chosen = heuristic_block_sizes(b, sq, k.shape[2], hpg, max(list_len, 1), warp_specialized=True, sparse=True)
    if chosen.compute_wgs == 2:
      return _sparse_prefill_either_order(q, k, v, block_ids, q_positions, scale=scale, block_sizes=chosen)
  return _run_kernel(
      q, k, v, q_positions, make_plan, max(list_len, 1), scale=scale, block_sizes=block_sizes,
      check_users=True, interpret=interpret,
  )


def _paged_sparse(q, k, v, block_ids, q_positions, page_table, *, scale, block_sizes, interpret):
  """sparse_attention over page pools: the query-major kernel (one or two compute warpgroups, as the heuristic
  picks) with each listed block read from its page."""
  num_keys = page_table.shape[1] * KEY_BLOCK
  hpg = _kernel_heads_per_group(q.shape[2] // k.shape[2])
  queries_per_tile = block_sizes.queries_per_tile if block_sizes else one_warpgroup_queries_per_tile(hpg, q.shape[1])
  list_len = max(min(block_ids.shape[3] * queries_per_tile, page_table.shape[1]), 1)
  if block_sizes is None and not interpret:
    block_sizes = heuristic_block_sizes(q.shape[0], q.shape[1], k.shape[2], hpg, list_len, warp_specialized=True,
                                        sparse=True)
  return _run_kernel(q, k, v, q_positions, _sparse_plan_builder(block_ids, num_keys), list_len, scale=scale,
                     block_sizes=block_sizes, check_users=True, interpret=interpret, page_table=page_table)


def _dense_kernel_attention(q, k, v, q_positions, *, scale, block_sizes, interpret, page_table=None):
  num_keys = k.shape[1] if page_table is None else page_table.shape[1] * KEY_BLOCK

  def make_plan(positions, sq_pad, qpt, wgs, heads_per_group):
    return dense_causal_plan(
        positions, num_keys=num_keys, num_kv_heads=k.shape[2], queries_per_tile=qpt,
        heads_per_group=heads_per_group, compute_wgs=wgs,
    )

  return _run_kernel(
      q, k, v, q_positions, make_plan, -(-num_keys // KEY_BLOCK), scale=scale, block_sizes=block_sizes,
      check_users=False, interpret=interpret, page_table=page_table,
  )


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_sizes", "use_cudnn"))
def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    scale: float,
    chunk_size: int = 512,
    interpret: Any = False,
    block_sizes: SparseAttentionBlockSizes | None = None,
    use_cudnn: bool | None = None,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Dense causal GQA attention: cuDNN for plain prefill, else the block-list kernel over all blocks.

  Args:
    q: [B, Sq, Nq, D]; k, v: [B, Sk, Nkv, D] (slot j holds position j); q_positions: int32 [B, Sq].
    scale: softmax scale. chunk_size: signature parity with the reference (unused).
    interpret: run the Pallas kernel in GPU interpret mode (never uses cuDNN).
    block_sizes: tuning of the Pallas kernel.
    use_cudnn: None = when Sq == Sk on a GPU backend (then q_positions == arange is checked at run
      time and other positions take the Pallas kernel); False = never.
    page_table: int32 [B, n] when k, v are page pools [P, 128, Nkv, D] (pallas_kernels._paging): block i of
      sequence b is read from pool page page_table[b, i] (the Pallas kernel, never cuDNN).

  Returns:
    [B, Sq, Nq, D] in q.dtype.
  """
  del chunk_size
  if page_table is not None:
    _check_paged(q, k, v, q_positions, page_table)
    return _dense_kernel_attention(q, k, v, q_positions, scale=scale, block_sizes=block_sizes, interpret=interpret,
                                   page_table=page_table)
  _check_qkv(q, k, v, q_positions)
  kernel = functools.partial(_dense_kernel_attention, scale=scale, block_sizes=block_sizes, interpret=interpret)
  if use_cudnn is None:
    use_cudnn = not interpret and jax.default_backend() == "gpu"
  if not use_cudnn or q.shape[1] != k.shape[1]:
    return kernel(q, k, v, q_positions)
  is_prefill = jnp.all(q_positions == jnp.arange(q.shape[1], dtype=q_positions.dtype)[None])

  def cudnn(q, k, v, q_positions):
    del q_positions
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")

  return jax.lax.cond(is_prefill, cudnn, kernel, q, k, v, q_positions)
