"""Persistent warp-specialized block-sparse GQA attention for Hopper (Pallas Mosaic GPU, prefill).

kernel_sm90_ws.py with each CTA owning several jobs (a job = one KV group of one query tile, numbered
group-major): CTA c of a batch row walks the block lists of jobs c, c + C, c + 2C, ... as one stream
(plan.PersistentPlan), so its K/V pipeline does not drain and refill between tiles, and the next job's
queries are prefetched while the current one runs. The jobs in flight are neighbours of one KV group (as
with one CTA per tile), which keeps that group's K/V in L2. K and V come in as [B, G * Sk_pad, D].

Per step the compute warpgroups do what kernel_sm90_ws.py does without the ping-pong (sparse plans run
unpaired); around it, on the first step of a tile k > 0 a warpgroup waits for that tile's queries
(prefetched into Q slot k % 2), waits until the previous tile's output store has read its slot, and
prefetches tile k + 1 into that slot; its accumulators restart. On the last step of a tile it writes
O / l through its Q slot.
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
from pallas_kernels.attention.plan import PersistentPlan, TilePlan

_MEMORY_REGISTERS = 40
_SLOTS = 2  # Q / output slots per compute warpgroup


def _persistent_kernel(
    q_ref, k_ref, v_ref, block_ref, users_ref, full_ref, info_ref, count_ref, num_jobs_ref, row_limit_ref,
    row_bit_ref, o_ref, qo_smem, limit_smem, bit_smem, p_smem, q_barrier, bit_barrier, *,
    queries_per_wg: int, heads_per_group: int, compute_wgs: int, ctas: int, tiles: int, key_blocks: int, stages: int,
    scale: float, head_dim: int, interpret: bool,
):
  """Refs (gmem unless noted):

  q_ref [B, Sq_pad, Nq, D]; k_ref, v_ref [B, G * Sk_pad, D]; block_ref, users_ref, full_ref, info_ref int32
  [B, C, L] and count_ref, num_jobs_ref int32 [B, C] (plan.PersistentPlan); row_limit_ref int32
  [B, tiles, W * 64]; row_bit_ref int32 [W * 64]; o_ref [1, B, Sq_pad, Nq, D].
  scratch (smem): qo_smem [2, W, 64, D] (Q slots: a tile's queries, then its output); limit_smem int32
  [2, W, 64]; bit_smem int32 [W, 64]; p_smem [W, 64, 128] or None; q_barrier (2 W barriers, slot-major);
  bit_barrier (W barriers).
  """
  cta = lax.axis_index("cta")
  batch = lax.axis_index("batch")
  wg = lax.axis_index("wg")
  queries_per_tile = queries_per_wg * compute_wgs
  at = (batch, cta)
  info_list, users_list, block_list, full_list = (r.at[batch, cta] for r in (info_ref, users_ref, block_ref, full_ref))
  my_mask = (1 << queries_per_wg) - 1
  num_tiles = num_jobs_ref[at]

  def job_of(ordinal):
    job = cta + ordinal * ctas
    return lax.div(job, tiles), lax.rem(job, tiles)  # (KV group, tile)

  def tile_of(ordinal):
    return job_of(ordinal)[1]

  def heads_of(ordinal):
    return pl.ds(job_of(ordinal)[0] * heads_per_group, heads_per_group)

  def my_first_query(ordinal):
    return tile_of(ordinal) * queries_per_tile + wg * queries_per_wg

  def load_tile(ordinal):
    """Starts the TMA loads of tile `ordinal`'s queries and row limits into slot ordinal % 2."""
    slot = lax.rem(ordinal, _SLOTS)
    barrier = q_barrier.at[slot * compute_wgs + wg]
    first = my_first_query(ordinal)
    heads = heads_of(ordinal)
    for i in range(queries_per_wg):
      plgpu.copy_gmem_to_smem(
          q_ref.at[batch, first + i, heads],
          qo_smem.at[slot, wg, pl.ds(i * heads_per_group, heads_per_group)],
          barrier,
      )
    plgpu.copy_gmem_to_smem(
        row_limit_ref.at[batch, tile_of(ordinal), pl.ds(wg * ROWS_PER_TILE, ROWS_PER_TILE)],
        limit_smem.at[slot, wg], barrier,
    )

  def init_carry():
    return (
        plgpu.layout_cast(jnp.zeros((ROWS_PER_TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        row_vector(-jnp.inf),
        row_vector(0.0),
    )

  def compute_context(run_pipeline):
    plgpu.copy_gmem_to_smem(row_bit_ref.at[pl.ds(wg * ROWS_PER_TILE, ROWS_PER_TILE)], bit_smem.at[wg],
                            bit_barrier.at[wg])
    plgpu.barrier_wait(bit_barrier.at[wg])

    @pl.when(num_tiles > 0)
    def _():
      load_tile(0)
      plgpu.barrier_wait(q_barrier.at[wg])

    @pl.when(num_tiles > 1)
    def _():
      load_tile(1)

    run_pipeline(init_carry())
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def attend(block, users, slot, k_smem, v_smem, k_consumed, v_consumed, carry, *, masked: bool):
    acc, m_i, l_i = carry
    my_q = qo_smem.at[slot, wg]

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, my_q, k_smem.transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS_PER_TILE, KEY_BLOCK), jnp.float32))
    plgpu.barrier_arrive(k_consumed)
    if masked:  # rows of queries that skip the block, and keys past a row's position, get -inf
      limit = plgpu.load(limit_smem.at[slot, wg], layout=ROW_LAYOUT)
      row_bit = plgpu.load(bit_smem.at[wg], layout=ROW_LAYOUT)
      limit = jnp.where((row_bit & users) != 0, limit, -1)
      s = mask_invisible_keys(s, limit, lax.rem(block, key_blocks))  # block: g * key_blocks + the group's block
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
    if not interpret:
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a_operand, v_smem))(plgpu.ACC.init(acc))
    else:  # GPU interpret mode has no pre-initialised accumulator

      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, a_operand, v_smem)
        return pv_ref[...]

      acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((ROWS_PER_TILE, head_dim), jnp.float32))
    plgpu.barrier_arrive(v_consumed)
    return acc, m_new, l_i

  def skip(k_consumed, v_consumed, carry):
    plgpu.barrier_arrive(k_consumed)
    plgpu.barrier_arrive(v_consumed)
    return carry

  def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
    step = idx[0]
    info = info_list[step]
    ordinal = lax.shift_right_logical(info, 2)
    first = (info & 1) != 0
    last = (info & 2) != 0
    slot = lax.rem(ordinal, _SLOTS)

    @pl.when(first & (ordinal > 0))
    def _():
      plgpu.barrier_wait(q_barrier.at[slot * compute_wgs + wg])  # this tile's queries are in
      if not interpret:
        # The previous tile's output store has read the other slot. (The GPU interpreter copies
        # synchronously, so there is nothing to wait for, and this wait inside a pipeline body hangs it.)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      @pl.when(ordinal + 1 < num_tiles)
      def _():
        load_tile(ordinal + 1)

    carry = lax.cond(first, lambda _: init_carry(), lambda old: old, carry)
    users = users_list[step]
    block = block_list[step]
    mine = lax.shift_right_logical(users, wg * queries_per_wg) & my_mask
    full = (lax.shift_right_logical(full_list[step], wg) & 1) != 0
    branch = jnp.where(mine == 0, 0, jnp.where(full, 1, 2))
    args = (block, users, slot, k_smem, v_smem, k_consumed, v_consumed)
    carry = lax.switch(
        branch,
        [
            functools.partial(skip, k_consumed, v_consumed),
            functools.partial(attend, *args, masked=False),
            functools.partial(attend, *args, masked=True),
        ],
        carry,
    )

    @pl.when(last)
    def _():
      acc, _, l_i = carry
      my_q = qo_smem.at[slot, wg]
      out = acc / lax.broadcast_in_dim(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape, [0])
      my_q[...] = out.astype(my_q.dtype)
      plgpu.commit_smem()
      first_query = my_first_query(ordinal)
      heads = heads_of(ordinal)
      for i in range(queries_per_wg):
        plgpu.copy_smem_to_gmem(my_q.at[pl.ds(i * heads_per_group, heads_per_group)],
                                o_ref.at[0, batch, first_query + i, heads])

    return carry

  def kv_spec():
    return plgpu.BlockSpec(
        (KEY_BLOCK, head_dim), lambda i: (block_list[i], 0), transforms=smem_transforms(k_ref.dtype)
    )

  pipeline = plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(count_ref[at],),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[kv_spec(), kv_spec()],
      max_concurrent_steps=stages,
      wg_axis="wg",
      num_compute_wgs=compute_wgs,
      compute_context=compute_context,
      manual_consumed_barriers=True,
  )
  pipeline(k_ref.at[batch], v_ref.at[batch])


def group_major(x: jax.Array) -> jax.Array:
  """[B, Sk_pad, G, D] -> [B, G * Sk_pad, D]: each KV group's keys contiguous (one copy of K or V)."""
  b, sk, g, d = x.shape
  return jnp.swapaxes(x, 1, 2).reshape(b, g * sk, d)


def persistent_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    plan: TilePlan,
    steps: PersistentPlan,
    *,
    scale: float,
    block_sizes: SparseAttentionBlockSizes,
    p_in_smem: bool | None = None,
    interpret: Any = False,
) -> tuple[jax.Array, None]:
  """Launches the persistent kernel (sparse plans, block_sizes.compute_wgs == 2, no ping-pong).

  Args:
    q: [B, Sq_pad, Nq, D] with Sq_pad % queries_per_tile == 0; k, v: [B, Sk_pad, Nkv, D], Sk_pad % 128 == 0.
    plan: the sparse TilePlan (its row limits and row bits are read here; its lists through `steps`).
    steps: persistent_plan(plan, ..., key_blocks=Sk_pad // 128) with C = steps.count.shape[1] CTAs per batch row.

  Returns:
    (o [1, B, Sq_pad, Nq, D] in q.dtype, None): the launch contract of kernel_sm90.attention_pallas.
  """
  b, sq_pad, nq, d = q.shape
  nkv = k.shape[2]
  hpg = nq // nkv
  wgs = block_sizes.compute_wgs
  qpt = block_sizes.queries_per_tile
  qpw = qpt // wgs
  ctas = steps.count.shape[1]
  sk_pad = k.shape[1]
  p_in_smem = bool(p_in_smem) or bool(interpret)
  if (wgs != 2 or block_sizes.num_splits != 1 or qpt % wgs or sq_pad % qpt or qpw * hpg > ROWS_PER_TILE
      or k.shape[1] % KEY_BLOCK or plan.row_limit.shape[-1] != wgs * ROWS_PER_TILE
      or steps.count.shape != (b, ctas)):
    raise ValueError(f"bad launch shapes: {q.shape=}, {k.shape=}, {block_sizes=}, {steps.count.shape=}")
  kernel = functools.partial(
      _persistent_kernel, queries_per_wg=qpw, heads_per_group=hpg, compute_wgs=wgs, ctas=ctas, tiles=sq_pad // qpt,
      key_blocks=sk_pad // KEY_BLOCK,
      stages=block_sizes.kv_stages, scale=scale, head_dim=d, interpret=bool(interpret),
  )
  scratch = [
      plgpu.SMEM((_SLOTS, wgs, ROWS_PER_TILE, d), q.dtype, transforms=smem_transforms(q.dtype)),
      plgpu.SMEM((_SLOTS, wgs, ROWS_PER_TILE), jnp.int32),
      plgpu.SMEM((wgs, ROWS_PER_TILE), jnp.int32),
      plgpu.SMEM((wgs, ROWS_PER_TILE, KEY_BLOCK), q.dtype, transforms=smem_transforms(q.dtype)) if p_in_smem else None,
      plgpu.Barrier(num_arrivals=qpw + 1, num_barriers=_SLOTS * wgs),
      plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
  ]
  o = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((1, b, sq_pad, nq, d), q.dtype),
      grid=(b, ctas),
      grid_names=("batch", "cta"),
      num_threads=wgs + 1,
      thread_name="wg",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name=f"m3_attention_persistent_q{qpt}_s{block_sizes.kv_stages}",
  )(q, group_major(k), group_major(v), steps.block, steps.users, steps.full, steps.info, steps.count, steps.num_jobs,
    plan.row_limit,
    plan.row_bit)
  return o, None
