"""KV-major block-sparse GQA attention for Hopper (Pallas Mosaic GPU, one or more warpgroups per CTA).

One CTA owns a work item of plan_kv_major.py: one key block of one KV group and up to C chunks of the
queries that selected it. It loads the block's K and V once, then (its W compute warpgroups taking turns:
warpgroup w takes chunks w, w + W, ..., each with its own query buffers) for each chunk of Qc queries (the wgmma
rows are Qc queries x the group's heads: 4 x 16 = 64 for M3), with the next chunks' queries loading
meanwhile (two Q buffers; KvMajorBlockSizes.output_staging sets how early a buffer is refilled):

  S = Q_chunk[64, D] . K_blk[128, D]^T * scale                (wgmma, fp32)
  S = where(key_slot <= row_limit, S, -inf)                   (token-causal; -1 rows are padding)
  m = max_k S, P = exp2(S log2e - m), l = sum_k P             (base 2, fp32; one block, no rescaling)
  O = P . V_blk / l                                           (wgmma, fp32; P in the input dtype)

and stores O (input dtype) and lse = m + log2(l) (fp32) into the (query, group, slot) entry of the partial
outputs, or (output_staging "q_buffer_one_store", "separate_one_store", "registers") in one piece into the
chunk's own 64 rows of a partial buffer laid out by (item, chunk), which plan.pair_slab maps back to the
pairs. api.py merges each query's partials with their log-sum-exp. Every wgmma row belongs to a selected
(query, block) pair, whatever the selections' overlap; the price is the partial outputs' traffic.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.config import CHUNK_LAYOUT_STAGINGS, KEY_BLOCK, ROWS_PER_TILE, SMEM_LIMIT_BYTES
from pallas_kernels.attention.config import KvMajorBlockSizes
from pallas_kernels.attention.kernel_sm90 import LOG2E, ROW_LAYOUT, mask_invisible_keys, p_times_v, smem_transforms
from pallas_kernels.attention.plan_kv_major import (
    ITEM_BATCH, ITEM_BLOCK, ITEM_COUNT, ITEM_GROUP, ITEM_START, KvMajorPlan, queries_per_chunk,
)


def _kv_major_kernel(
    q_ref, k_ref, v_ref, items_ref, pair_query_ref, pair_slot_ref, chunk_limit_ref, o_ref, lse_ref,
    k_smem, v_smem, q_smem, limit_smem, o_smem, lse_smem, p_smem, kv_barrier, q_barrier, *,
    chunk_queries: int, chunks_per_item: int, heads_per_group: int, scale: float, head_dim: int, staging: str,
    compute_wgs: int,
):
  """Refs (gmem unless noted):

  q_ref [B, Sq_pad, Nq, D]; k_ref, v_ref [B, Sk_pad, Nkv, D]; items_ref int32 [N, 5]; pair_query_ref,
  pair_slot_ref int32 [P]; chunk_limit_ref int32 [N, C, 64];
  outputs: o_ref [B, Sq_pad, Nkv, T, hpg, D], lse_ref fp32 [B, Sq_pad, Nkv, T, hpg] (base 2, scale included);
    with the stagings laid out by chunk ("*_one_store", "registers"): o_ref [N * C * 64, D], lse_ref fp32
    [N * C * 64] (rows of chunk c of item i at (i * C + c) * 64);
  scratch (smem; W = compute_wgs, the leading W axes are per warpgroup): k_smem, v_smem [128, D]; q_smem
  [W, 2, 64, D]; limit_smem int32 [W, 2, 64]; o_smem: None (staging "q_buffer": a chunk's output goes to its
  own Q buffer, and the prefetch into a buffer first waits for the stores out of it; "registers": no
  staging), [W, 64, D] ("separate", "separate_one_store") or [W, 64, 64] ("halves": the output leaves in
  64-column parts); with "halves", "separate_one_store" and "registers" the buffer of a warpgroup's chunk c
  is refilled with its chunk c + 2W right after S = QK^T; lse_smem fp32 [W, 64] (None with "registers");
  p_smem [W, 64, 128] (None: P stays in registers); kv_barrier (2 arrivals); q_barrier (2W barriers of
  Qc + 1 arrivals: stage s of warpgroup w is barrier 2w + s).
  """
  item = lax.axis_index("item")
  batch = items_ref[item, ITEM_BATCH]
  group = items_ref[item, ITEM_GROUP]
  block = items_ref[item, ITEM_BLOCK]
  start = items_ref[item, ITEM_START]
  count = items_ref[item, ITEM_COUNT]
  heads = pl.ds(group * heads_per_group, heads_per_group)
  num_chunks = lax.div(count + chunk_queries - 1, chunk_queries)
  # Warpgroup w of W takes the item's chunks w, w + W, ...; the per-warpgroup scratch is indexed by w.
  wg = lax.axis_index("wg") if compute_wgs > 1 else 0
  q_smem, limit_smem = q_smem.at[wg], limit_smem.at[wg]
  o_smem = None if o_smem is None else o_smem.at[wg]
  lse_smem = None if lse_smem is None else lse_smem.at[wg]
  p_smem = None if p_smem is None else p_smem.at[wg]

  def q_ready(stage):
    return q_barrier.at[wg * 2 + stage]

  def load_chunk(chunk, stage):
    for r in range(chunk_queries):  # rows past the item's pairs load its last query (their rows are masked)
      pair = start + jnp.minimum(chunk * chunk_queries + r, count - 1)
      plgpu.copy_gmem_to_smem(
          q_ref.at[batch, pair_query_ref[pair], heads],
          q_smem.at[stage, pl.ds(r * heads_per_group, heads_per_group)],
          q_ready(stage),
      )
    plgpu.copy_gmem_to_smem(chunk_limit_ref.at[item, chunk], limit_smem.at[stage], q_ready(stage))

  direct = staging == "registers"
  by_chunk = staging in CHUNK_LAYOUT_STAGINGS
  early_refill = staging in ("halves", "registers", "separate_one_store")
  part_width = o_smem.shape[-1] if o_smem is not None else head_dim

  def prefetch(chunk, stage):
    @pl.when(chunk < num_chunks)
    def _load():
      if o_smem is None and not direct:  # the previous chunk's output, in the buffer to be refilled, has been read
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load_chunk(chunk, stage)

  def chunk_body(step, carry):
    chunk = wg + step * compute_wgs
    stage = lax.rem(step, 2)
    if not early_refill:
      prefetch(chunk + compute_wgs, 1 - stage)

    plgpu.barrier_wait(q_ready(stage))

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[stage], k_smem.transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS_PER_TILE, KEY_BLOCK), jnp.float32))
    s = mask_invisible_keys(s, plgpu.load(limit_smem.at[stage], layout=ROW_LAYOUT), block)
    if early_refill:  # every thread is past its reads of this stage's Q (wgmma) and limits: refill it
      plgpu.commit_smem()
      prefetch(chunk + 2 * compute_wgs, stage)
    c = scale * LOG2E
    m = s.max(axis=1) * c
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l = p.sum(axis=1)
    o = p_times_v(p.astype(v_smem.dtype), p_smem, v_smem, head_dim)
    empty = l == 0.0
    out = (o / lax.broadcast_in_dim(jnp.where(empty, 1.0, l), o.shape, [0])).astype(q_smem.dtype)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, l)) * LOG2E)
    if by_chunk:  # the chunk's 64 rows, padding rows included (their lse is -inf and no pair maps to them)
      rows = pl.ds((item * chunks_per_item + chunk) * ROWS_PER_TILE, ROWS_PER_TILE)
      if direct:
        o_ref.at[rows][...] = out
        lse_ref.at[rows][...] = lse
      else:  # through the chunk's Q buffer or the output buffer: one store of the output, one of the lse
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem = q_smem.at[stage] if o_smem is None else o_smem
        out_smem[...] = out
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[rows])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[rows])
      return carry
    out_smem = q_smem.at[stage] if o_smem is None else o_smem
    for part in range(head_dim // part_width):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous stores have read o / lse smem
      out_smem[...] = out if part_width == head_dim else out[:, part * part_width:(part + 1) * part_width]
      if part == 0:
        lse_smem[...] = lse
      plgpu.commit_smem()
      for r in range(chunk_queries):
        index = chunk * chunk_queries + r

        @pl.when(index < count)
        def _store():
          pair = start + index
          rows = pl.ds(r * heads_per_group, heads_per_group)
          dst = (batch, pair_query_ref[pair], group, pair_slot_ref[pair])
          o_dst = o_ref.at[dst]
          if part_width != head_dim:
            o_dst = o_dst.at[:, pl.ds(part * part_width, part_width)]
          plgpu.copy_smem_to_gmem(out_smem.at[rows], o_dst)
          if part == 0:
            plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[dst])

    return carry

  @pl.when(count > 0)
  def _work():
    kv = pl.ds(block * KEY_BLOCK, KEY_BLOCK)

    @pl.when(wg == 0)
    def _load_kv():
      plgpu.copy_gmem_to_smem(k_ref.at[batch, kv, group], k_smem, kv_barrier.at[0])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, kv, group], v_smem, kv_barrier.at[0])

    prefetch(wg, 0)
    if early_refill:
      prefetch(wg + compute_wgs, 1)
    plgpu.barrier_wait(kv_barrier.at[0])
    steps = lax.div(num_chunks - wg + compute_wgs - 1, compute_wgs)
    lax.fori_loop(0, steps, chunk_body, 0)
    plgpu.wait_smem_to_gmem(0)


def kv_major_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: KvMajorPlan,
    *,
    scale: float,
    block_sizes: KvMajorBlockSizes,
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array]:
  """Launches the kernel.

  Args:
    q: [B, Sq_pad, Nq, D] (heads per KV group a multiple of 8, <= 64); k, v: [B, Sk_pad, Nkv, D],
      Sk_pad % 128 == 0.
    plan: KvMajorPlan built for these shapes, heads per group and block_sizes.chunks_per_item.

  Returns:
    (o [B, Sq_pad, Nkv, T, hpg, D] in q.dtype, lse fp32 [B, Sq_pad, Nkv, T, hpg] base 2): entries of the
    slots plan.valid marks; the others are left unwritten. With a staging laid out by chunk ("registers",
    "q_buffer_one_store", "separate_one_store"; heads per group dividing 64): (o [N * C * 64, D], lse
    fp32 [N * C * 64]), whose rows viewed as [N * C * Qc, hpg] slabs hold the pairs at plan.pair_slab
    (rows of chunks an item does not have are left unwritten).
  """
  b, sq_pad, nq, d = q.shape
  nkv = k.shape[2]
  hpg = nq // nkv
  t = plan.valid.shape[-1]
  qc = queries_per_chunk(hpg)
  n_items, chunks, rows = plan.chunk_limit.shape
  if (hpg % 8 or hpg > ROWS_PER_TILE or k.shape[1] % KEY_BLOCK or rows != ROWS_PER_TILE
      or chunks != block_sizes.chunks_per_item or plan.valid.shape != (b, sq_pad, nkv, t)):
    raise ValueError(f"bad launch shapes: {q.shape=}, {k.shape=}, {plan.chunk_limit.shape=}, {plan.valid.shape=}")
  staging = block_sizes.output_staging
  if block_sizes.smem_bytes(d, q.dtype.itemsize) > SMEM_LIMIT_BYTES:
    raise ValueError(f"{block_sizes} needs {block_sizes.smem_bytes(d, q.dtype.itemsize)} B of shared memory for "
                     f"head dim {d}, over the {SMEM_LIMIT_BYTES} B of an SM: use fewer warpgroups")
  if staging == "halves" and d % 64:
    raise ValueError(f"output_staging='halves' needs a head dim that is a multiple of 64, got {d}")
  direct = staging == "registers"
  by_chunk = staging in CHUNK_LAYOUT_STAGINGS
  if by_chunk and ROWS_PER_TILE % hpg:
    raise ValueError(f"output_staging={staging!r} needs heads per group dividing {ROWS_PER_TILE}, got {hpg}")
  p_in_smem = bool(interpret)
  wgs = block_sizes.compute_wgs
  kernel = functools.partial(
      _kv_major_kernel, chunk_queries=qc, chunks_per_item=chunks, heads_per_group=hpg, scale=scale, head_dim=d,
      staging=staging, compute_wgs=wgs,
  )
  o_columns = block_sizes.output_buffer_columns(d)
  tiled = dict(transforms=smem_transforms(q.dtype))
  scratch = [
      plgpu.SMEM((KEY_BLOCK, d), k.dtype, **tiled),
      plgpu.SMEM((KEY_BLOCK, d), v.dtype, **tiled),
      plgpu.SMEM((wgs, 2, ROWS_PER_TILE, d), q.dtype, **tiled),
      plgpu.SMEM((wgs, 2, ROWS_PER_TILE), jnp.int32),
      None if o_columns is None else plgpu.SMEM((wgs, ROWS_PER_TILE, o_columns), q.dtype, **tiled),
      None if direct else plgpu.SMEM((wgs, ROWS_PER_TILE), jnp.float32),
      plgpu.SMEM((wgs, ROWS_PER_TILE, KEY_BLOCK), q.dtype, **tiled) if p_in_smem else None,
      plgpu.Barrier(num_arrivals=2, num_barriers=1),
      plgpu.Barrier(num_arrivals=qc + 1, num_barriers=2 * wgs),
  ]
  o, lse = plgpu.kernel(
      kernel,
      out_type=[
          jax.ShapeDtypeStruct((n_items * chunks * ROWS_PER_TILE, d), q.dtype),
          jax.ShapeDtypeStruct((n_items * chunks * ROWS_PER_TILE,), jnp.float32),
      ] if by_chunk else [
          jax.ShapeDtypeStruct((b, sq_pad, nkv, t, hpg, d), q.dtype),
          jax.ShapeDtypeStruct((b, sq_pad, nkv, t, hpg), jnp.float32),
      ],
      grid=(n_items,),
      grid_names=("item",),
      **(dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=f"m3_attention_kv_major_c{chunks}_{staging}" + (f"_w{wgs}" if wgs > 1 else ""),
  )(q, k, v, plan.items, plan.pair_query, plan.pair_slot, plan.chunk_limit)
  return o, lse
