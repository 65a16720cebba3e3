"""Grouped per-expert GEMM for Hopper (sm90), Pallas Mosaic GPU: TMA + wgmma, warp specialized.

One kernel serves both MoE projections:

* gate_up: ``n_parts=2``, ``epilogue="swiglu"``. Each work item loads one lhs tile and the matching
  gate *and* up column tiles of the expert's ``[K, 2N]`` weight (gate cols ``[0, N)``, up cols
  ``[N, 2N)``), accumulates both in fp32 and writes ``swiglu_oai(gate, up)`` (fp32 math, one rounding).
* down: ``n_parts=1``, ``epilogue="none"``.

Rows of ``lhs`` come grouped in ``block_m``-row tiles; every tile belongs to exactly one expert
(``meta[1 + tile]``), and tile id ``E`` (== number of routed experts) selects ``w_shared`` instead,
so the shared expert runs in the same persistent launch. ``meta[0]`` is the number of live tiles;
the persistent grid walks ``meta[0] * (N // block_n)`` work items (m-tile major) and never touches
dead tiles, so decode reads each touched expert's weights once per n-tile, i.e. exactly once.

Three warpgroups per CTA: one TMA producer and two wgmma consumers that split the CTA tile by rows
(``wg_split="m"``: 64 rows each, full-width wgmma N for fewer SMEM reads per FLOP) or by columns
(``wg_split="n"``: decode tiles of 64 rows).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.config import MoeBlockSizes

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_NUM_COMPUTE_WGS = 2
_EPI_N = 64  # epilogue SMEM staging chunk (columns)


def _swiglu_epilogue(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """SwiGLU-OAI on fp32 accumulators: (clip(u, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.minimum(jnp.maximum(up, -limit), limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def _tile_transforms(minor_elems: int, dtype: Any) -> tuple[Any, ...]:
  """Tiling + swizzle transforms for an SMEM tile whose minor dim has ``minor_elems`` elements."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _grouped_kernel(
    meta_gmem,  # int32 [1 + max_tiles]
    lhs_gmem,  # [M_pad, K]
    w_gmem,  # [E, K, n_parts * N]
    *rest,  # (ws_gmem [K, n_parts * N],)? then out_gmem [M_pad, N]
    n_parts: int,
    epilogue: str,
    alpha: float,
    limit: float,
    bs: MoeBlockSizes,
    broadcast_lhs: bool,
):
  """Kernel body; see the module docstring. Runs on a ("sm",) grid with a "wg" thread axis."""
  ws_gmem, out_gmem = (rest if len(rest) == 2 else (None, rest[0]))
  bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
  wg_bm, wg_bn = bs.wg_tile()
  epi_n = min(wg_bn, _EPI_N)
  num_experts = w_gmem.shape[0]
  k = lhs_gmem.shape[1]
  n_out = out_gmem.shape[1]
  n_tiles = n_out // bn
  dtype = lhs_gmem.dtype
  out_dtype = out_gmem.dtype
  in_transforms = _tile_transforms(bk, dtype)
  out_transforms = _tile_transforms(epi_n, out_dtype)

  in_specs = [plgpu.BlockSpec((bm, bk), lambda ki: (0, ki), transforms=in_transforms)]
  in_specs += [
      plgpu.BlockSpec((bk, bn), lambda ki: (ki, 0), transforms=in_transforms) for _ in range(n_parts)
  ]

  def make_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // bk,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=bs.max_concurrent_steps,
        compute_context=compute_context,
    )

  def w_views(w2d):  # w2d: [K, n_parts * N] -> n_parts [K, bn] column tiles for n-tile ni
    return lambda ni: [w2d.at[:, pl.ds(p * n_out + ni * bn, bn)] for p in range(n_parts)]

  ignore = lambda *_, **__: None
  alloc_refs = [lhs_gmem.at[pl.ds(0, bm), :], *w_views(w_gmem.at[0])(0)]

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(*alloc_refs),
      out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, wg_bm, epi_n), out_dtype, transforms=out_transforms),
      collective_axes="wg",
  )
  def _scope(allocs, out_smem):
    wg = lax.axis_index("wg")
    m_split = bs.wg_split == "m"
    wg_row0 = wg * wg_bm if m_split else 0  # this WG's rows / cols inside the CTA tile
    wg_col0 = 0 if m_split else wg * wg_bn
    wg_rows = pl.ds(wg_row0, wg_bm)
    wg_cols = pl.ds(wg_col0, wg_bn)
    num_live_tiles = meta_gmem[0]

    @plgpu.nd_loop((num_live_tiles * n_tiles,), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      mi = lax.div(lin, jnp.int32(n_tiles))
      ni = lax.rem(lin, jnp.int32(n_tiles))
      expert = meta_gmem[1 + mi]
      lhs_rows = pl.ds(0, bm) if broadcast_lhs else pl.ds(mi * bm, bm)  # every tile reads lhs rows [0, bm)

      def compute_context(run_pipeline):
        accs = [plgpu.ACC((wg_bm, wg_bn), jnp.float32) for _ in range(n_parts)]

        def _acc_scope(*acc_refs):
          run_pipeline(tuple(acc_refs))
          if epilogue == "swiglu":
            y = _swiglu_epilogue(acc_refs[0][...], acc_refs[1][...], alpha=alpha, limit=limit)
          else:
            y = acc_refs[0][...]
          y = y.astype(out_dtype)
          out_rows = pl.ds(mi * bm + wg_row0, wg_bm)
          for c in range(wg_bn // epi_n):  # stage through SMEM in [wg_bm, epi_n] chunks
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this WG's previous store read SMEM
            out_smem[wg] = y[:, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            col0 = ni * bn + wg_col0 + c * epi_n
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[out_rows, pl.ds(col0, epi_n)])

        pl.run_scoped(_acc_scope, *accs)

      def mma_body(_, lhs_smem, *rest_refs):
        *w_smems, acc_refs = rest_refs
        for acc_ref, w_smem in zip(acc_refs, w_smems):
          plgpu.wgmma(acc_ref, lhs_smem.at[wg_rows], w_smem.at[:, wg_cols])
        plgpu.wgmma_wait(0)
        return acc_refs

      def run_for(w2d):
        make_pipeline(mma_body, compute_context)(
            lhs_gmem.at[lhs_rows, :], *w_views(w2d)(ni), allocations=allocs
        )

      if ws_gmem is None:
        run_for(w_gmem.at[expert])
      else:
        pl.when(expert < num_experts)(lambda: run_for(w_gmem.at[expert]))
        pl.when(expert >= num_experts)(lambda: run_for(ws_gmem))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_grouped_shapes(lhs_shape, w_shape, n_parts: int, bs: MoeBlockSizes) -> None:
  """Raises NotImplementedError if (lhs [M_pad, K], w [E, K, n_parts*N]) does not tile with ``bs``."""
  m_pad, k = lhs_shape
  n = w_shape[2] // n_parts
  if m_pad % bs.block_m:
    raise NotImplementedError(f"{m_pad=} must be a multiple of {bs.block_m=}")
  if k % bs.block_k:
    raise NotImplementedError(f"reduction dim {k=} must be a multiple of {bs.block_k=}")
  if n % bs.block_n:
    raise NotImplementedError(f"output dim {n=} must be a multiple of {bs.block_n=}")


def grouped_matmul(
    meta: jax.Array,
    lhs: jax.Array,
    w: jax.Array,
    w_shared: jax.Array | None,
    *,
    n_parts: int,
    epilogue: str,
    out_dtype: Any,
    block_sizes: MoeBlockSizes,
    alpha: float = 1.702,
    limit: float = 7.0,
    num_sms: int = 132,
    interpret: Any = False,
    broadcast_lhs: bool = False,
) -> jax.Array:
  """Tile-grouped GEMM with an optional fused SwiGLU-OAI epilogue.

  Args:
    meta: int32 [1 + max_tiles]; meta[0] = live tiles, meta[1 + t] = expert of tile t (E = shared).
    lhs: [M_pad, K] (bf16/f16), M_pad = max_tiles * block_m; with broadcast_lhs, [block_m, K], the rows
      of every tile (the broadcast dispatch layout: decode, T <= block_m tokens).
    w: [E, K, n_parts * N] expert weights; w_shared: [K, n_parts * N] or None.
    n_parts: 2 for gate_up (gate cols first, then up), 1 for down.
    epilogue: "swiglu" (needs n_parts=2) or "none".
    out_dtype: dtype of the [M_pad, N] result.
    interpret: False, or plgpu.InterpretGPUParams() to run on CPU.
    broadcast_lhs: see lhs.

  Returns:
    [M_pad, N] in out_dtype; rows of dead tiles are left unwritten.
  """
  if lhs.dtype not in _SUPPORTED_DTYPES or w.dtype != lhs.dtype:
    raise NotImplementedError(f"grouped_matmul supports bf16/f16 operands, got {lhs.dtype}, {w.dtype}")
  if (epilogue == "swiglu") != (n_parts == 2):
    raise ValueError(f"{epilogue=} needs n_parts=2, got {n_parts=}")
  check_grouped_shapes(lhs.shape, w.shape, n_parts, block_sizes)
  if broadcast_lhs and lhs.shape[0] != block_sizes.block_m:
    raise ValueError(f"broadcast_lhs needs lhs of block_m={block_sizes.block_m} rows, got {lhs.shape}")
  wg_bm, wg_bn = block_sizes.wg_tile()
  if n_parts * wg_bm * wg_bn > 128 * 128:
    raise ValueError(f"{block_sizes}: {n_parts} fp32 accumulators of {wg_bm}x{wg_bn} per warpgroup "
                     "exceed 128 registers per thread")
  m_pad = (meta.shape[0] - 1) * block_sizes.block_m if broadcast_lhs else lhs.shape[0]
  n = w.shape[2] // n_parts
  operands = [meta, lhs, w] + ([] if w_shared is None else [w_shared.astype(lhs.dtype)])
  kernel = plgpu.kernel(
      functools.partial(
          _grouped_kernel, n_parts=n_parts, epilogue=epilogue, alpha=alpha, limit=limit,
          bs=block_sizes, broadcast_lhs=broadcast_lhs,
      ),
      out_type=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret or None,
      kernel_name=f"moe_grouped_{epilogue}_bm{block_sizes.block_m}_bn{block_sizes.block_n}",
  )
  return kernel(*operands)
