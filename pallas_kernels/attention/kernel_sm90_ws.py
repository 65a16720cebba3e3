"""Warp-specialized block-list GQA flash attention for Hopper (Pallas Mosaic GPU, prefill).

One CTA owns (query tile, KV group g) with three warpgroups. The last one only streams the tile's
block list (plan.py) through a TMA pipeline of K and V blocks; the two compute warpgroups each own
half of the tile's queries (64 wgmma rows: 4 queries x 16 heads for M3), so every K/V block load
feeds 128 rows, twice the arithmetic per loaded byte of kernel_sm90.py. Per list entry, a compute
warpgroup whose queries all skipped the block (its bits of the entry's user mask are 0) does nothing;
otherwise, as kernel_sm90.py:

  S = Q_wg[64, D] . K_blk[128, D]^T * scale                   (wgmma, fp32)
  S = where(key_slot <= row_limit and the row's query uses the block, S, -inf)
  online softmax in base 2 (fp32), P cast to the input dtype, O = O * alpha + P . V_blk (wgmma, fp32)

(the mask is skipped for blocks every query of the warpgroup uses and sees entirely) and writes O / l in
the input dtype. For dense plans the two compute warpgroups alternate on the tensor cores (a schedule
barrier, as in FlashAttention-3: ping_pong="every"); sparse plans run them unpaired (ping_pong="off"),
coupled only by the K/V pipeline. Each releases its K (V) buffer right after its Q.K (P.V) wgmma.
No splits (prefill has enough tiles to fill the GPU).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.config import KEY_BLOCK, ROWS_PER_TILE, SparseAttentionBlockSizes
from pallas_kernels.attention.kernel_sm90 import LOG2E, ROW_LAYOUT, mask_invisible_keys, row_vector, smem_transforms
from pallas_kernels.attention.plan import TilePlan

_MEMORY_REGISTERS = 40


def _ws_attention_kernel(
    q_ref, k_ref, v_ref, blocks_ref, users_ref, count_ref, row_limit_ref, row_bit_ref, *refs,
    queries_per_wg: int, heads_per_group: int, compute_wgs: int, stages: int, scale: float, head_dim: int,
    check_users: bool, acc_in_place: bool, ping_pong: str, paged: bool = False,
):
  """Refs (gmem unless noted):

  q_ref [B, Sq_pad, Nq, D]; k_ref, v_ref [B, Sk_pad, Nkv, D]; blocks_ref, users_ref int32 [B, tiles, G, U];
  count_ref int32 [B, tiles, G]; row_limit_ref int32 [B, tiles, W * 64]; row_bit_ref int32 [W * 64];
  paged: then pages_ref int32 [B, tiles, G, U] follows (the pool block each listed block is read from) and
  k_ref, v_ref are the page pools [1, P * 128, Nkv, D];
  o_ref [1, B, Sq_pad, Nq, D].
  scratch (smem): qo_smem [W, 64, D] (each warpgroup's query tile, then its output tile); limit_smem,
  bit_smem int32 [W, 64]; p_smem [W, 64, 128] (None: P stays in registers); q_barrier (W barriers);
  schedule_barrier (W arrivals): the compute warpgroups take turns on the tensor cores (FlashAttention-3's
  ping-pong: one's softmax overlaps the other's wgmma) when ping_pong == "every" (see
  SparseAttentionBlockSizes.ping_pong); "off" lets them run unpaired.
  """
  if paged:
    pages_ref, o_ref, *refs = refs
  else:
    (o_ref, *refs), pages_ref = refs, blocks_ref
  qo_smem, limit_smem, bit_smem, p_smem, q_barrier, schedule_barrier = refs
  tile = lax.axis_index("tile")
  group = lax.axis_index("group")
  batch = lax.axis_index("batch")
  kv_batch = 0 if paged else batch
  wg = lax.axis_index("wg")
  first_query = tile * (queries_per_wg * compute_wgs)
  heads = pl.ds(group * heads_per_group, heads_per_group)
  list_ref = blocks_ref.at[batch, tile, group]
  pages_list_ref = pages_ref.at[batch, tile, group]
  users_list_ref = users_ref.at[batch, tile, group]
  my_mask = (1 << queries_per_wg) - 1

  paired = ping_pong == "every"

  def schedule():
    """One turn of the ping-pong (nothing when the warpgroups run unpaired)."""
    if paired:
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

  def compute_context(run_pipeline):
    my_q = qo_smem.at[wg]
    my_first = first_query + wg * queries_per_wg
    for i in range(queries_per_wg):
      plgpu.copy_gmem_to_smem(
          q_ref.at[batch, my_first + i, heads], my_q.at[pl.ds(i * heads_per_group, heads_per_group)],
          q_barrier.at[wg],
      )
    plgpu.copy_gmem_to_smem(row_limit_ref.at[batch, tile, pl.ds(wg * ROWS_PER_TILE, ROWS_PER_TILE)],
                            limit_smem.at[wg], q_barrier.at[wg])
    plgpu.copy_gmem_to_smem(row_bit_ref.at[pl.ds(wg * ROWS_PER_TILE, ROWS_PER_TILE)], bit_smem.at[wg],
                            q_barrier.at[wg])
    plgpu.barrier_wait(q_barrier.at[wg])
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS_PER_TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        row_vector(-jnp.inf),
        row_vector(0.0),
    )
    pl.when(wg == 1)(schedule)  # warpgroup 0 takes the tensor cores first
    acc, _, l_i = run_pipeline(init)
    pl.when(wg == 0)(schedule)
    empty = l_i == 0.0
    out = acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, l_i), acc.shape, [0])
    my_q[...] = out.astype(my_q.dtype)
    plgpu.commit_smem()
    for i in range(queries_per_wg):
      plgpu.copy_smem_to_gmem(my_q.at[pl.ds(i * heads_per_group, heads_per_group)],
                              o_ref.at[0, batch, my_first + i, heads])
    plgpu.wait_smem_to_gmem(0)

  def skip(k_consumed, v_consumed, carry):
    plgpu.barrier_arrive(k_consumed)
    schedule()
    schedule()
    plgpu.barrier_arrive(v_consumed)
    return carry

  def attend(block, users, k_smem, v_smem, k_consumed, v_consumed, carry, *, masked: bool):
    acc, m_i, l_i = carry
    my_q = qo_smem.at[wg]

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, my_q, k_smem.transpose((1, 0)))
      schedule()
      return acc_ref[...]

    s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS_PER_TILE, KEY_BLOCK), jnp.float32))
    plgpu.barrier_arrive(k_consumed)
    if masked:  # rows of queries that skip the block, and keys past a row's position, get -inf
      limit = plgpu.load(limit_smem.at[wg], layout=ROW_LAYOUT)
      if check_users:
        row_bit = plgpu.load(bit_smem.at[wg], layout=ROW_LAYOUT)
        limit = jnp.where((row_bit & users) != 0, limit, -1)
      s = mask_invisible_keys(s, limit, block)

    # m is kept in base-2 units of the scaled scores: exp2(s * c - m) is one FMA per element
    c = scale * LOG2E
    m_new = jnp.maximum(m_i, s.max(axis=1) * c)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    p16 = p.astype(v_smem.dtype)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if p_smem is not None:  # GPU interpret mode only takes wgmma's A operand from shared memory
      p_smem.at[wg][...] = p16
      plgpu.commit_smem()
    a_operand = p16 if p_smem is None else p_smem.at[wg]
    schedule()
    if acc_in_place:  # accumulate P.V into the rescaled O (no second accumulator)
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a_operand, v_smem))(plgpu.ACC.init(acc))
    else:  # GPU interpret mode has no pre-initialised accumulator: a fresh one, added in registers

      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, a_operand, v_smem)
        return pv_ref[...]

      acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((ROWS_PER_TILE, head_dim), jnp.float32))
    plgpu.barrier_arrive(v_consumed)
    return acc, m_new, l_i

  # The smallest position among this warpgroup's queries (-1 if any is padding): a block whose last key
  # it reaches, used by all of the warpgroup's queries, needs no mask.
  # (Computed by every thread; the memory warpgroup's index is clamped to stay in bounds, its value unused.)
  first_row = jnp.minimum(wg, compute_wgs - 1) * ROWS_PER_TILE
  wg_min_limit = row_limit_ref[batch, tile, first_row]
  for i in range(1, queries_per_wg):
    wg_min_limit = jnp.minimum(wg_min_limit, row_limit_ref[batch, tile, first_row + i * heads_per_group])

  def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
    entry = idx[0]
    users = users_list_ref[entry]
    block = list_ref[entry]
    mine = lax.shift_right_logical(users, wg * queries_per_wg) & my_mask
    full = (mine == my_mask) & ((block + 1) * KEY_BLOCK - 1 <= wg_min_limit)
    branch = jnp.where(mine == 0, 0, jnp.where(full, 1, 2))
    args = (block, users, k_smem, v_smem, k_consumed, v_consumed)
    return lax.switch(
        branch,
        [
            functools.partial(skip, k_consumed, v_consumed),
            functools.partial(attend, *args, masked=False),
            functools.partial(attend, *args, masked=True),
        ],
        carry,
    )

  def kv_spec():
    return plgpu.BlockSpec(
        (KEY_BLOCK, head_dim), lambda i: (pages_list_ref[i], 0), transforms=smem_transforms(k_ref.dtype)
    )

  pipeline = plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(count_ref[batch, tile, group],),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[kv_spec(), kv_spec()],
      max_concurrent_steps=stages,
      wg_axis="wg",
      num_compute_wgs=compute_wgs,
      compute_context=compute_context,
      manual_consumed_barriers=True,
  )
  pipeline(k_ref.at[kv_batch, :, group, :], v_ref.at[kv_batch, :, group, :])


def ws_attention_pallas(
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
) -> tuple[jax.Array, None]:
  """Launches the warp-specialized kernel (block_sizes.compute_wgs == 2).

  Args:
    q: [B, Sq_pad, Nq, D] with Sq_pad % queries_per_tile == 0; k, v: [B, Sk_pad, Nkv, D], Sk_pad % 128 == 0.
    plan: TilePlan built with queries_per_tile and compute_wgs of block_sizes.
    check_users: mask each row by its query's bit of the entry's user mask (sparse plans).
    p_in_smem: stage P through shared memory for the P.V wgmma (always in interpret mode).
    pages: int32 [B, tiles, G, U], the 128-key block of k / v each plan entry is read from, when k, v are page
      pools [1, P * 128, Nkv, D] (plan.blocks stay the logical blocks, which the causal mask uses).

  Returns:
    (o [1, B, Sq_pad, Nq, D] in q.dtype, None): the launch contract of kernel_sm90.attention_pallas.
  """
  b, sq_pad, nq, d = q.shape
  nkv = k.shape[2]
  hpg = nq // nkv
  wgs = block_sizes.compute_wgs
  qpt = block_sizes.queries_per_tile
  qpw = qpt // wgs
  p_in_smem = bool(p_in_smem) or bool(interpret)
  if (wgs != 2 or block_sizes.num_splits != 1 or qpt % wgs or sq_pad % qpt or qpw * hpg > ROWS_PER_TILE
      or k.shape[1] % KEY_BLOCK or plan.row_limit.shape[-1] != wgs * ROWS_PER_TILE):
    raise ValueError(f"bad launch shapes: {q.shape=}, {k.shape=}, {block_sizes=}, {plan.row_limit.shape=}")
  kernel = functools.partial(
      _ws_attention_kernel, queries_per_wg=qpw, heads_per_group=hpg, compute_wgs=wgs,
      stages=block_sizes.kv_stages, scale=scale, head_dim=d, check_users=check_users,
      # The ping-pong only orders the two warpgroups' turns on the tensor cores (results do not depend on
      # it). The GPU interpreter runs each simulated warpgroup on a pool thread; its barrier waits block
      # those threads, and with the extra rendezvous per step it deadlocked intermittently on a 2-core CPU
      # (4 CTAs; never on the GPU, where a CTA's warpgroups are co-resident). So it is off when interpreting.
      acc_in_place=not interpret, ping_pong="off" if interpret else block_sizes.ping_pong, paged=pages is not None,
  )
  scratch = [
      plgpu.SMEM((wgs, ROWS_PER_TILE, d), q.dtype, transforms=smem_transforms(q.dtype)),
      plgpu.SMEM((wgs, ROWS_PER_TILE), jnp.int32),
      plgpu.SMEM((wgs, ROWS_PER_TILE), jnp.int32),
      plgpu.SMEM((wgs, ROWS_PER_TILE, KEY_BLOCK), q.dtype, transforms=smem_transforms(q.dtype)) if p_in_smem else None,
      plgpu.Barrier(num_arrivals=qpw + 2, num_barriers=wgs),
      plgpu.Barrier(num_arrivals=wgs),
  ]
  o = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((1, b, sq_pad, nq, d), q.dtype),
      # the last grid axis is CUDA x: consecutive CTAs are consecutive tiles of one KV group (shared K/V in L2)
      grid=(b, nkv, sq_pad // qpt),
      grid_names=("batch", "group", "tile"),
      num_threads=wgs + 1,
      thread_name="wg",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=f"m3_attention_ws_q{qpt}_s{block_sizes.kv_stages}",
  )(q, k, v, plan.blocks, plan.users, plan.count, plan.row_limit, plan.row_bit, *(() if pages is None else (pages,)))
  return o, None
