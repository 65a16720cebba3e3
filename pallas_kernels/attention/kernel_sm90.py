"""Block-list GQA flash attention for Hopper (Pallas Mosaic GPU, one warpgroup per CTA).

One CTA owns (query tile, KV group g, split): the wgmma M rows are the tile's Q queries x the group's
heads (64 rows for M3: 4 queries x 16 heads), so all heads of a group share every K/V load. It walks
its slice of the tile's block list (plan.py) through a TMA pipeline of K and V blocks:

  S = Q_tile[64, D] . K_blk[128, D]^T * scale                 (wgmma, fp32)
  S = where(key_slot <= row_limit and the row's query uses the block, S, -inf)
  online softmax in base 2 (fp32), P cast to the input dtype, O += P . V_blk (wgmma, fp32)

and writes O / l in the input dtype. With num_splits > 1 each split also writes its base-2
log-sum-exp, and api.py merges the partial outputs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.config import KEY_BLOCK, ROWS_PER_TILE, SparseAttentionBlockSizes
from pallas_kernels.attention.plan import TilePlan

ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)
LOG2E = math.log2(math.e)


def smem_transforms(dtype) -> tuple[Any, ...]:
  swizzle = 128
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def row_vector(value):
  return plgpu.layout_cast(jnp.full((ROWS_PER_TILE,), value, dtype=jnp.float32), ROW_LAYOUT)


def mask_invisible_keys(s, limit, block):
  """s [64, 128] scores of key block ``block``: keys past each row's last visible key slot ``limit`` [64]
  (row layout; -1 hides the whole row) get -inf."""
  key_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS_PER_TILE, KEY_BLOCK), 1, layout=plgpu.Layout.WGMMA)
  visible = key_ids <= lax.broadcast_in_dim(limit - block * KEY_BLOCK, s.shape, [0])
  return jnp.where(visible, s, -jnp.inf)


def p_times_v(p16, p_smem, v_smem, head_dim: int):
  """P [64, 128] (input dtype, registers) . V_blk [128, D] (smem) into a fresh fp32 [64, D] accumulator. With
  p_smem (GPU interpret mode, which only takes wgmma's A operand from shared memory) P is staged there first."""
  if p_smem is not None:
    p_smem[...] = p16
    plgpu.commit_smem()

  def pv_scope(pv_ref):
    plgpu.wgmma(pv_ref, p16 if p_smem is None else p_smem, v_smem)
    return pv_ref[...]

  return pl.run_scoped(pv_scope, plgpu.ACC((ROWS_PER_TILE, head_dim), jnp.float32))


def _attention_kernel(
    q_ref, k_ref, v_ref, blocks_ref, users_ref, count_ref, row_limit_ref, row_bit_ref, *refs,
    queries_per_tile: int, heads_per_group: int, num_splits: int, list_per_split: int, stages: int,
    scale: float, head_dim: int, check_users: bool, paged: bool = False,
):
  """Refs (gmem unless noted):

  q_ref [B, Sq_pad, Nq, D]; k_ref, v_ref [B, Sk_pad, Nkv, D];
  blocks_ref, users_ref int32 [B, tiles, G, U]; count_ref int32 [B, tiles, G];
  row_limit_ref int32 [B, tiles, 64]; row_bit_ref int32 [64];
  paged: then pages_ref int32 [B, tiles, G, U] follows (the pool block each listed block is read from) and
  k_ref, v_ref are the page pools [1, P * 128, Nkv, D];
  outputs: o_ref [S, B, Sq_pad, Nq, D] (+ lse_ref fp32 [S, B, Sq_pad, Nq] when S = num_splits > 1);
  scratch: qo_smem [64, D] (query tile, then output tile), limit_smem, bit_smem int32 [64],
  lse_smem fp32 [64], p_smem [64, 128] (None: P stays in registers as wgmma's A operand), load_barrier.
  """
  pages_ref = blocks_ref
  if paged:
    pages_ref, *refs = refs
  if num_splits > 1:
    o_ref, lse_ref, *refs = refs
  else:
    (o_ref, *refs), lse_ref = refs, None
  qo_smem, limit_smem, bit_smem, lse_smem, p_smem, load_barrier = refs
  tile = lax.axis_index("tile")
  group_split = lax.axis_index("group_split")
  batch = lax.axis_index("batch")
  group = lax.div(group_split, num_splits)
  split = lax.rem(group_split, num_splits)
  first_query = tile * queries_per_tile
  heads = pl.ds(group * heads_per_group, heads_per_group)

  for i in range(queries_per_tile):
    plgpu.copy_gmem_to_smem(
        q_ref.at[batch, first_query + i, heads],
        qo_smem.at[pl.ds(i * heads_per_group, heads_per_group)],
        load_barrier.at[0],
    )
  plgpu.copy_gmem_to_smem(row_limit_ref.at[batch, tile], limit_smem, load_barrier.at[0])
  plgpu.copy_gmem_to_smem(row_bit_ref, bit_smem, load_barrier.at[0])
  plgpu.barrier_wait(load_barrier.at[0])
  row_limit = plgpu.load(limit_smem, layout=ROW_LAYOUT)
  row_bit = plgpu.load(bit_smem, layout=ROW_LAYOUT)

  count = count_ref[batch, tile, group]
  start = split * list_per_split
  stop = jnp.minimum(start + list_per_split, count)
  list_ref = blocks_ref.at[batch, tile, group]
  pages_list_ref = pages_ref.at[batch, tile, group]
  users_list_ref = users_ref.at[batch, tile, group]
  kv_batch = 0 if paged else batch

  def kv_spec():
    return plgpu.BlockSpec(
        (None, KEY_BLOCK, None, head_dim),
        lambda i: (kv_batch, pages_list_ref[start + i], group, 0),
        transforms=smem_transforms(k_ref.dtype),
    )

  def body(idx, k_smem, v_smem, carry):
    acc, m_i, l_i = carry
    entry = start + idx[0]
    block = list_ref[entry]

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, qo_smem, k_smem.transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS_PER_TILE, KEY_BLOCK), jnp.float32))
    s = s * (scale * LOG2E)
    limit = row_limit
    if check_users:
      limit = jnp.where((row_bit & users_list_ref[entry]) != 0, row_limit, -1)
    s = mask_invisible_keys(s, limit, block)

    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    p16 = p.astype(v_smem.dtype)

    # P.V goes to a fresh accumulator and is added in registers (a pre-initialised accumulator,
    # pl.run_state(...)(plgpu.ACC.init(acc)), has no GPU-interpret-mode implementation).
    pv = p_times_v(p16, p_smem, v_smem, head_dim)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
    return acc, m_new, l_i

  init = (
      plgpu.layout_cast(jnp.zeros((ROWS_PER_TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA),
      row_vector(-jnp.inf),
      row_vector(0.0),
  )
  acc, m_i, l_i = plgpu.emit_pipeline(
      body,
      grid=(jnp.maximum(stop - start, 0),),
      in_specs=[kv_spec(), kv_spec()],
      max_concurrent_steps=stages,
      init_carry=init,
  )(k_ref, v_ref)

  empty = l_i == 0.0
  out = acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, l_i), acc.shape, [0])
  qo_smem[...] = out.astype(qo_smem.dtype)
  if lse_ref is not None:
    lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)) * LOG2E)
  plgpu.commit_smem()
  for i in range(queries_per_tile):
    rows = pl.ds(i * heads_per_group, heads_per_group)
    plgpu.copy_smem_to_gmem(qo_smem.at[rows], o_ref.at[split, batch, first_query + i, heads])
    if lse_ref is not None:
      plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[split, batch, first_query + i, heads])
  plgpu.wait_smem_to_gmem(0)


def attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: TilePlan,
    *,
    scale: float,
    block_sizes: SparseAttentionBlockSizes,
    check_users: bool,
    p_in_smem: bool | None = None,
    interpret: Any = False,
    pages: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Launches the kernel.

  Args:
    q: [B, Sq_pad, Nq, D] with Sq_pad % queries_per_tile == 0; k, v: [B, Sk_pad, Nkv, D], Sk_pad % 128 == 0.
    plan: TilePlan built for these shapes and block_sizes.queries_per_tile.
    scale: softmax scale.
    check_users: False when every listed block is used by every query of the tile (dense plans), which
      skips the per-block user mask.
    p_in_smem: stage P through shared memory for the P.V wgmma (always in interpret mode, which cannot
      take wgmma's A operand from registers; by default P stays in registers on the GPU).
    pages: int32 [B, tiles, G, U], the 128-key block of k / v each plan entry is read from, when k, v are page
      pools [1, P * 128, Nkv, D] (plan.blocks stay the logical blocks, which the causal mask uses).

  Returns:
    (o [S, B, Sq_pad, Nq, D] in q.dtype, lse fp32 [S, B, Sq_pad, Nq] base-2 or None when S == 1).
  """
  b, sq_pad, nq, d = q.shape
  nkv = k.shape[2]
  p_in_smem = bool(p_in_smem) or bool(interpret)
  hpg = nq // nkv
  qpt = block_sizes.queries_per_tile
  splits = block_sizes.num_splits
  list_len = plan.blocks.shape[-1]
  list_per_split = -(-list_len // splits)
  num_tiles = sq_pad // qpt
  if sq_pad % qpt or qpt * hpg > ROWS_PER_TILE or k.shape[1] % KEY_BLOCK:
    raise ValueError(f"bad launch shapes: {q.shape=}, {k.shape=}, {qpt=}")
  out_type = [jax.ShapeDtypeStruct((splits, b, sq_pad, nq, d), q.dtype)]
  if splits > 1:
    out_type.append(jax.ShapeDtypeStruct((splits, b, sq_pad, nq), jnp.float32))
  kernel = functools.partial(
      _attention_kernel, queries_per_tile=qpt, heads_per_group=hpg, num_splits=splits,
      list_per_split=list_per_split, stages=block_sizes.kv_stages, scale=scale, head_dim=d,
      check_users=check_users, paged=pages is not None,
  )
  scratch = [
      plgpu.SMEM((ROWS_PER_TILE, d), q.dtype, transforms=smem_transforms(q.dtype)),
      plgpu.SMEM((ROWS_PER_TILE,), jnp.int32),
      plgpu.SMEM((ROWS_PER_TILE,), jnp.int32),
      plgpu.SMEM((ROWS_PER_TILE,), jnp.float32),
      plgpu.SMEM((ROWS_PER_TILE, KEY_BLOCK), q.dtype, transforms=smem_transforms(q.dtype)) if p_in_smem else None,
      plgpu.Barrier(num_arrivals=qpt + 2, num_barriers=1),
  ]
  outs = plgpu.kernel(
      kernel,
      out_type=out_type,
      # Mosaic maps the last grid axis to CUDA x (the fastest-launched, 2^31 - 1 limit; y/z <= 65535):
      # consecutive CTAs are consecutive tiles of one KV group, which share its K/V blocks in L2.
      grid=(b, nkv * splits, num_tiles),
      grid_names=("batch", "group_split", "tile"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=f"m3_attention_q{qpt}_s{block_sizes.kv_stages}_split{splits}",
  )(q, k, v, plan.blocks, plan.users, plan.count, plan.row_limit, plan.row_bit, *(() if pages is None else (pages,)))
  return outs[0], (outs[1] if splits > 1 else None)
