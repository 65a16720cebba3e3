"""Grouped GEMM with fp8 weights for Hopper (sm90), Pallas Mosaic GPU: W8A16, TMA + wgmma, warp specialized.

``out[rows of tile t] = act(lhs[rows of t] @ W[expert(t)]^T)`` where W is a ``QuantizedWeight``'s values
``[E, n_parts * N, K]`` float8_e4m3fn in the checkpoint's ``[out, in]`` orientation, read from HBM as 1 byte a
weight plus its block scales, dequantized tile by tile in registers (``pallas_kernels._fp8_tiles``: exact for
both formats) and multiplied on the bf16 tensor cores with fp32 accumulation.

The GEMM runs "swapped": the weights are wgmma's A operand (64 weight rows per consumer warpgroup, from
registers after dequantization, K-major as the checkpoint stores them) and the ``block_m`` rows (tokens) of a
tile are its N dimension (B = the token tile, K-major, read from SMEM transposed), so a decode tile of 1-8
tokens costs a wgmma with N = 8 instead of 64 padded rows, and no weight tile is ever written back to SMEM.
Each warpgroup's fp32 accumulators are [64 weight rows, block_m tokens]; the epilogue (SwiGLU-OAI for gate_up,
fp32) stores them transposed into the ``[tokens, N]`` output.

Work items are (tile, 128-row n-tile, K split) triples walked by a persistent grid (``meta`` as
``kernel_sm90``: live tile count, then each tile's expert; id E selects the shared expert). An item's block
scales (the whole K range of its 2 x 64 rows) are copied into SMEM once, by a bulk copy beside the value
pipeline. ``k_splits > 1`` (the dense decode projections: few n-tiles, long K) writes fp32 partial sums
``[k_splits, N, M_pad]`` (transposed: as the accumulators hold them) that the caller adds; an fp32 ``out_dtype``
without a split is stored the same way, ``[1, N, M_pad]``.

gate_up: ``n_parts=2`` (gate rows ``[0, N)``, up rows ``[N, 2N)`` of each expert, as the checkpoint stores
``gate_up_proj``), ``epilogue="swiglu"``; down: ``n_parts=1``, ``epilogue="none"``.

NVFP4 (W4A16): the values are packed uint8 ``[E, n_parts * N, K / 2]`` (``pallas_kernels._nvfp4_tiles``). A step
covers 256 inputs: a ``[bn, 128]``-byte tile per part (the fp8 tiles' SMEM layout) and its ``[bn, 16]`` e4m3 group
scales travel through the same TMA pipeline (no per-item scale copy), and each 64-row group runs two wgmmas, the
low nibbles against the step's even inputs and the high nibbles against its odd inputs (the activations are
permuted once per call, ``_nvfp4_tiles.deinterleave_k``). The per (expert, part) fp32 global multiplier is read
once per item. No K split (the MoE GEMMs do not use one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _fp8_tiles as tiles
from pallas_kernels import _nvfp4_tiles as nv_tiles
from pallas_kernels.quant import QuantizedWeight

_NUM_COMPUTE_WGS = 2
BLOCK_K = tiles.BLOCK_K
_EPI_COLS = tiles.ROWS  # each warpgroup stores its [block_m, 64] output slice
SCALE_K_ALIGN = 512  # fp8_block / split K: K per split a multiple of this (16-byte scale copies)
SMEM_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Tiles:
  """Tiles of one fp8 grouped GEMM.

  block_m: token rows of a tile (wgmma N): a multiple of 8 in [8, 256] (gate_up: <= 128, two accumulators).
  max_concurrent_steps: TMA pipeline depth (stages of [block_m, 128] bf16 + n_parts x [128, 128] fp8).
  k_splits: K ranges per (tile, n-tile); > 1 returns fp32 partial sums.
  row_tiles: 64-row weight tiles per warpgroup and part (1 or 2): an item covers block_n = 128 * row_tiles
    output features (2: fewer, longer items where K is short, e.g. the down projection).
  """

  block_m: int = 64
  max_concurrent_steps: int = 3
  k_splits: int = 1
  row_tiles: int = 1

  def __post_init__(self):
    if self.block_m % 8 or not 8 <= self.block_m <= 256:
      raise ValueError(f"block_m must be a multiple of 8 in [8, 256], got {self.block_m}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
    if self.k_splits < 1:
      raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")
    if self.row_tiles not in (1, 2):
      raise ValueError(f"row_tiles must be 1 or 2, got {self.row_tiles}")

  @property
  def block_n(self) -> int:
    """Output features of one work item (per part)."""
    return tiles.ROWS * self.row_tiles * _NUM_COMPUTE_WGS

  def smem_bytes(self, n_parts: int, k: int, fmt: str, out_itemsize: int) -> int:
    """Shared memory of one CTA (allocations rounded up to 1 KiB, as Mosaic aligns them, plus barriers):
    pipeline stages, the item's scales, the epilogue staging tiles."""
    up = lambda b: -(-b // 1024) * 1024
    if fmt == "nvfp4":  # 256 inputs a step: bf16 activations, packed bytes and the e4m3 scales per part
      stage = (up(self.block_m * nv_tiles.BLOCK_K * 2) + n_parts * up(self.block_n * nv_tiles.BYTES_K)
               + n_parts * up(self.block_n * nv_tiles.SCALES_PER_STEP))
      epilogue = up(_NUM_COMPUTE_WGS * self.block_m * _EPI_COLS * out_itemsize)
      return stage * self.max_concurrent_steps + epilogue + 2048
    stage = up(self.block_m * BLOCK_K * 2) + n_parts * up(self.block_n * BLOCK_K)
    kc = k // self.k_splits
    per_group = tiles.ROWS * kc // 32 if fmt == "mxfp8" else 4 * kc // 128
    scales = up(_NUM_COMPUTE_WGS * n_parts * self.row_tiles * per_group)
    epilogue = up(_NUM_COMPUTE_WGS * self.block_m * _EPI_COLS * out_itemsize)
    return stage * self.max_concurrent_steps + scales + epilogue + 2048


def _swiglu(gate, up, *, alpha: float, limit: float):
  gate = jnp.minimum(gate, limit)
  up = jnp.minimum(jnp.maximum(up, -limit), limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def _kernel(meta_gmem, lhs_gmem, w_gmem, s_gmem, *rest, n_parts, epilogue, alpha, limit, cfg: Fp8Tiles,
            broadcast_lhs, fmt, has_shared, interpret):
  """Kernel body (module docstring); an ("sm",) grid of CTAs with a "wg" thread axis (2 consumers + 1 TMA)."""
  nvfp4 = fmt == "nvfp4"
  gm_gmem = None
  if nvfp4:  # the global multipliers [E (+1: the shared expert), n_parts] come last before the output
    *rest, gm_gmem, out_gmem = rest
    rest = (*rest, out_gmem)
  if has_shared:
    ws_gmem, ss_gmem, out_gmem = rest
  else:
    (out_gmem,), ws_gmem, ss_gmem = rest, None, None
  bm, bn, rows = cfg.block_m, cfg.block_n, tiles.ROWS
  bk = nv_tiles.BLOCK_K if nvfp4 else BLOCK_K  # inputs per step
  subs = cfg.row_tiles
  wg_rows = rows * subs
  groups = [(p, sub) for p in range(n_parts) for sub in range(subs)]  # accumulator g = p * subs + sub
  num_experts = w_gmem.shape[0]
  k = lhs_gmem.shape[1]
  kc = k // cfg.k_splits
  n_out = w_gmem.shape[1] // n_parts  # output features per part
  n_tiles = n_out // bn
  out_dtype = out_gmem.dtype
  split_out = cfg.k_splits > 1 or out_dtype == jnp.float32  # fp32 results stay as the accumulators hold them
  lhs_transforms = tiles.bf16_tile_transforms(bk)

  in_specs = [plgpu.BlockSpec((bm, bk), lambda ki: (0, ki), transforms=lhs_transforms)]
  in_specs += [plgpu.BlockSpec((bn, tiles.BLOCK_K), lambda ki: (0, ki), transforms=tiles.fp8_tile_transforms())
               for _ in range(n_parts)]
  if nvfp4:  # the step's e4m3 group scales (as uint8) per part, row-major
    in_specs += [plgpu.BlockSpec((bn, nv_tiles.SCALES_PER_STEP), lambda ki: (0, ki)) for _ in range(n_parts)]

  def make_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(kc // bk,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context)

  def views(w2d, ni, ks, s2d=None):  # n_parts [bn, kc] row tiles of a [n_parts * N, K] weight for n-tile ni, split ks
    if nvfp4:  # packed bytes [bn, kc / 2] and scales [bn, kc / 16] of each part
      per_byte, per_scale = 2, 16
      return ([w2d.at[pl.ds(p * n_out + ni * bn, bn), pl.ds(ks * kc // per_byte, kc // per_byte)]
               for p in range(n_parts)]
              + [s2d.at[pl.ds(p * n_out + ni * bn, bn), pl.ds(ks * kc // per_scale, kc // per_scale)]
                 for p in range(n_parts)])
    return [w2d.at[pl.ds(p * n_out + ni * bn, bn), pl.ds(ks * kc, kc)] for p in range(n_parts)]

  row_bytes = kc // tiles.MX_BLOCK  # mxfp8 codes per row and item
  flat_codes = fmt == "mxfp8" and cfg.k_splits == 1  # s_gmem is [.., R * K/32 / 16, 16] (see kernel_scales)
  if fmt == "mxfp8":
    group_shape = (rows * row_bytes // 16, 16) if flat_codes else (rows, row_bytes)
    scale_alloc = plgpu.SMEM((_NUM_COMPUTE_WGS, len(groups), *group_shape), jnp.uint8)
  elif nvfp4:  # scales come through the pipeline; a placeholder keeps the scope's signature
    scale_alloc = plgpu.SMEM((_NUM_COMPUTE_WGS, 1, 4), jnp.float32)
  else:
    scale_alloc = plgpu.SMEM((_NUM_COMPUTE_WGS, len(groups), kc // 128), jnp.float32)
  if split_out:  # fp32 partial sums stored as they sit in the accumulators: [64 features, bm tokens]
    swizzle = plgpu.find_swizzle(bm * 32)
    out_tile = (_NUM_COMPUTE_WGS, rows, bm)
    out_transforms = (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))
  else:  # stored transposed: [bm tokens, 64 features]
    out_tile = (_NUM_COMPUTE_WGS, bm, _EPI_COLS)
    out_transforms = tiles.bf16_tile_transforms(_EPI_COLS)
  scoped = dict(
      out_smem=plgpu.SMEM(out_tile, out_dtype, transforms=out_transforms),
      scale_smem=scale_alloc,
      scale_barrier=plgpu.Barrier(num_arrivals=len(groups), num_barriers=_NUM_COMPUTE_WGS),
  )
  if interpret:  # the interpreter's wgmma reads A from SMEM only
    scoped["a_smem"] = plgpu.SMEM((_NUM_COMPUTE_WGS, rows, tiles.BLOCK_K), jnp.bfloat16,
                                  transforms=tiles.bf16_tile_transforms(tiles.BLOCK_K))
  ignore = lambda *_, **__: None
  alloc_refs = [lhs_gmem.at[pl.ds(0, bm), pl.ds(0, kc)], *views(w_gmem.at[0], 0, 0, s_gmem.at[0])]

  @functools.partial(pl.run_scoped, allocs=make_pipeline(ignore, ignore).get_allocations(*alloc_refs),
                     collective_axes="wg", **scoped)
  def _scope(allocs, out_smem, scale_smem, scale_barrier, a_smem=None):
    wg = lax.axis_index("wg")
    num_live_tiles = meta_gmem[0]

    @plgpu.nd_loop((num_live_tiles * n_tiles * cfg.k_splits,), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      ks = lax.rem(lin, jnp.int32(cfg.k_splits))
      mn = lax.div(lin, jnp.int32(cfg.k_splits))
      mi = lax.div(mn, jnp.int32(n_tiles))
      ni = lax.rem(mn, jnp.int32(n_tiles))
      expert = meta_gmem[1 + mi]
      lhs_rows = pl.ds(0, bm) if broadcast_lhs else pl.ds(mi * bm, bm)
      gmuls = [gm_gmem[expert, p] for p in range(n_parts)] if nvfp4 else None

      def load_scales(s_ref):
        """This warpgroup's block scales for the item (all its 64-row groups, the split's K range) into SMEM."""
        for g, (p, sub) in enumerate(groups):
          row0 = p * n_out + ni * bn + wg * wg_rows + sub * rows
          if flat_codes:  # the group's 64 rows of codes are contiguous: 64 * K/32 bytes
            src = s_ref.at[pl.ds(lax.div(row0, rows) * (rows * row_bytes // 16), rows * row_bytes // 16), :]
          elif fmt == "mxfp8":
            src = s_ref.at[pl.ds(row0, rows), pl.ds(ks * row_bytes, row_bytes)]
          else:
            src = s_ref.at[lax.div(row0, 128), pl.ds(ks * (kc // 128), kc // 128)]
          # In bounds by construction; the promise lets a contiguous range go as one bulk copy (no TMA box).
          plgpu.copy_gmem_to_smem(src, scale_smem.at[wg, g], scale_barrier.at[wg],
                                  oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.barrier_wait(scale_barrier.at[wg])

      def compute_context(run_pipeline):
        if nvfp4:  # the scales come through the pipeline
          pass
        elif ws_gmem is None:
          load_scales(s_gmem.at[expert])
        else:
          pl.when(expert < num_experts)(lambda: load_scales(s_gmem.at[expert]))
          pl.when(expert >= num_experts)(lambda: load_scales(ss_gmem))
        accs = [plgpu.ACC((rows, bm), jnp.float32) for _ in groups]

        def _acc_scope(*acc_refs):
          run_pipeline(tuple(acc_refs))
          dst = out_gmem.at[ks] if split_out else out_gmem
          for sub in range(subs):
            if epilogue == "swiglu":
              y = _swiglu(acc_refs[sub][...], acc_refs[subs + sub][...], alpha=alpha, limit=limit)
            else:
              y = acc_refs[sub][...]
            y = y.astype(out_dtype)  # [64 weight rows, bm tokens]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this WG's previous store has read its SMEM
            col0 = ni * bn + wg * wg_rows + sub * rows
            if split_out:
              out_smem[wg] = y
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg], dst.at[pl.ds(col0, rows), pl.ds(mi * bm, bm)])
              continue
            if interpret:
              out_smem[wg] = y.T
            else:
              out_smem.at[wg].transpose((1, 0))[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], dst.at[pl.ds(mi * bm, bm), pl.ds(col0, rows)])

        pl.run_scoped(_acc_scope, *accs)

      def mma_body_nvfp4(lhs_smem, w_smems, s_smems, acc_refs):
        halves = [lhs_smem.at[:, pl.ds(h * tiles.BLOCK_K, tiles.BLOCK_K)].transpose((1, 0)) for h in range(2)]
        for g, (p, sub) in enumerate(groups):
          acc = acc_refs[g]
          wg_rows_ds = pl.ds(wg * wg_rows + sub * rows, rows)
          w_tile, s_tile = w_smems[p].at[wg_rows_ds], s_smems[p].at[wg_rows_ds]
          for half in range(2):  # low nibbles x even inputs, high nibbles x odd inputs
            if interpret:
              a_smem[wg] = nv_tiles.dequant_jnp(w_tile[...], s_tile[...], gmuls[p], half)
              plgpu.commit_smem()
              plgpu.wgmma(acc, a_smem.at[wg], halves[half])
              plgpu.wgmma_wait(0)  # a_smem is rewritten for the next half
            else:
              plgpu.wgmma(acc, nv_tiles.dequant_gpu(w_tile, s_tile, gmuls[p], half), halves[half])
        plgpu.wgmma_wait(0)
        return acc_refs

      def mma_body(idx, lhs_smem, *rest_refs):
        (ki,) = idx
        *w_smems, acc_refs = rest_refs
        if nvfp4:
          return mma_body_nvfp4(lhs_smem, w_smems[:n_parts], w_smems[n_parts:], acc_refs)
        b = lhs_smem.transpose((1, 0))  # [bk, bm]: the tokens as wgmma's N
        for g, (p, sub) in enumerate(groups):
          acc = acc_refs[g]
          w_tile = w_smems[p].at[pl.ds(wg * wg_rows + sub * rows, rows)]
          if fmt != "mxfp8":
            scale = scale_smem[wg, g, ki]
          if interpret:
            if fmt == "mxfp8":
              a = tiles.dequant_mx_jnp(w_tile[...], tiles.codes_for_step(scale_smem[wg, g], ki, row_bytes))
            else:
              a = tiles.dequant_block_jnp(w_tile[...], scale)
            a_smem[wg] = a
            plgpu.commit_smem()
            plgpu.wgmma(acc, a_smem.at[wg], b)
          else:
            if fmt == "mxfp8":
              a = tiles.dequant_mx_gpu(w_tile, scale_smem.at[wg, g], ki, row_bytes)
            else:
              a = tiles.dequant_block_gpu(w_tile, scale)
            plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return acc_refs

      def run_for(w2d, s2d):
        make_pipeline(mma_body, compute_context)(
            lhs_gmem.at[lhs_rows, pl.ds(ks * kc, kc)], *views(w2d, ni, ks, s2d), allocations=allocs)

      if ws_gmem is None:
        run_for(w_gmem.at[expert], s_gmem.at[expert])
      else:
        pl.when(expert < num_experts)(lambda: run_for(w_gmem.at[expert], s_gmem.at[expert]))
        pl.when(expert >= num_experts)(lambda: run_for(ws_gmem, ss_gmem))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _interpret_mode_forced() -> bool:
  """Whether ``plgpu.force_gpu_interpret_mode`` / ``set_gpu_interpret_mode`` is in effect."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def kernel_scales(w: QuantizedWeight, k_splits: int = 1) -> jax.Array:
  """The scales as the kernel reads them. mxfp8: the codes' bytes unchanged, viewed as [..., R * K/32 / 16, 16]
  when K is not split (a free reshape: every 16-byte row stride lets one copy take a 64-row group, whatever K/32
  is), else [..., R, K/32]. fp8_block: fp32 [..., R/128, K/128] (an E8M0 block grid converted: 1/16384 of the
  values' size). nvfp4: the e4m3 scales' bytes as uint8 [..., R, K/16]."""
  if w.fmt == "nvfp4":
    return lax.bitcast_convert_type(w.scales, jnp.uint8)
  if w.fmt == "mxfp8":
    if k_splits == 1:
      return w.scales.reshape(*w.scales.shape[:-2], w.scales.shape[-2] * w.scales.shape[-1] // 16, 16)
    return w.scales
  if w.scales.dtype == jnp.uint8:
    from pallas_kernels.quant import scales_to_float  # pylint: disable=g-import-not-at-top
    return scales_to_float(w.scales)
  return w.scales.astype(jnp.float32)


def part_multipliers(global_scale: jax.Array, n_parts: int) -> jax.Array:
  """nvfp4 global multipliers [E, P] -> fp32 [E, n_parts], one per kernel part (P must divide n_parts: each
  kernel part's rows then share one multiplier)."""
  p = global_scale.shape[-1]
  if n_parts % p:
    raise NotImplementedError(f"nvfp4 global scale of {p} row parts does not fit a GEMM of {n_parts} parts")
  return jnp.repeat(global_scale.astype(jnp.float32), n_parts // p, axis=-1)


def check_fp8_shapes(w: QuantizedWeight, n_parts: int, k: int, cfg: Fp8Tiles) -> None:
  """NotImplementedError unless ``w`` ([E, n_parts * N, K] or [n_parts * N, K]) tiles with the kernel."""
  rows, kk = w.shape[-2:]
  if kk != k:
    raise ValueError(f"weight reduction dim {kk} != activations' {k}")
  if w.fmt == "nvfp4":
    if cfg.k_splits != 1:
      raise NotImplementedError(f"nvfp4 kernels do not split K, got k_splits={cfg.k_splits}")
    if k % nv_tiles.BLOCK_K:
      raise NotImplementedError(f"nvfp4 kernels need the reduction dim {k} to be a multiple of {nv_tiles.BLOCK_K}")
  if w.fmt == "fp8_block" and tuple(w.block) != (128, 128):
    raise NotImplementedError(f"fp8_block kernels need 128 x 128 blocks, got {w.block}")
  n = rows // n_parts
  if rows % n_parts or n % cfg.block_n:
    raise NotImplementedError(f"output features per part ({rows} / {n_parts}) must be a multiple of "
                              f"block_n={cfg.block_n}")
  kc = k // cfg.k_splits
  if k % cfg.k_splits or kc % BLOCK_K:
    raise NotImplementedError(f"reduction dim {k} / k_splits {cfg.k_splits} must be a multiple of {BLOCK_K}")
  # An item's scales travel as one copy per 64 rows: contiguous rows (mxfp8, whole K: 64 * K/32 bytes) need
  # nothing more; a K range of mxfp8 codes (a 2D box) or an fp32 block-scale row needs 16-byte multiples.
  if (w.fmt == "fp8_block" or cfg.k_splits > 1) and kc % SCALE_K_ALIGN:
    raise NotImplementedError(f"{w.fmt} with k_splits={cfg.k_splits}: the reduction range per split ({kc}) must "
                              f"be a multiple of {SCALE_K_ALIGN}")


def grouped_matmul_fp8(
    meta: jax.Array,
    lhs: jax.Array,
    w: QuantizedWeight,
    w_shared: QuantizedWeight | None,
    *,
    n_parts: int,
    epilogue: str,
    out_dtype: Any,
    tiles_cfg: Fp8Tiles,
    alpha: float = 1.702,
    limit: float = 7.0,
    num_sms: int = 132,
    interpret: Any = False,
    broadcast_lhs: bool = False,
) -> jax.Array:
  """Tile-grouped GEMM ``lhs @ W[expert]^T`` with fp8 weights (module docstring).

  Args:
    meta: int32 [1 + max_tiles]; meta[0] = live tiles, meta[1 + t] = expert of tile t (E = shared).
    lhs: bf16 [M_pad, K], M_pad = max_tiles * block_m; with broadcast_lhs, [block_m, K], the rows of every tile.
    w: QuantizedWeight [E, n_parts * N, K]; w_shared: QuantizedWeight [n_parts * N, K] (same format) or None.
    n_parts / epilogue: 2 / "swiglu" (gate rows first, then up) or 1 / "none".
    out_dtype: dtype of the [M_pad, N] result (when tiles_cfg.k_splits > 1: fp32 partial sums, transposed,
      [k_splits, N, M_pad]; fp32 without a split: transposed too, [1, N, M_pad]).
    interpret: False, or plgpu.InterpretGPUParams() to run on CPU.

  Returns:
    [M_pad, N] (or [k_splits, N, M_pad] fp32 partial sums); rows of dead tiles are left unwritten.
  """
  if lhs.dtype != jnp.bfloat16:
    raise NotImplementedError(f"fp8 grouped GEMM takes bf16 activations, got {lhs.dtype}")
  if (epilogue == "swiglu") != (n_parts == 2):
    raise ValueError(f"{epilogue=} needs n_parts=2, got {n_parts=}")
  if w.ndim != 3:
    raise ValueError(f"w must be [E, n_parts * N, K], got {w.shape}")
  cfg = tiles_cfg
  k = lhs.shape[1]
  check_fp8_shapes(w, n_parts, k, cfg)
  if w_shared is not None:
    if w_shared.fmt != w.fmt or w_shared.shape != w.shape[1:]:
      raise ValueError(f"shared weight {w_shared.fmt} {w_shared.shape} must match the experts' "
                       f"{w.fmt} {w.shape[1:]}")
  if lhs.shape[0] % cfg.block_m:
    raise NotImplementedError(f"lhs rows {lhs.shape[0]} must be a multiple of block_m={cfg.block_m}")
  if broadcast_lhs and lhs.shape[0] != cfg.block_m:
    raise ValueError(f"broadcast_lhs needs lhs of block_m={cfg.block_m} rows, got {lhs.shape}")
  if n_parts * cfg.row_tiles * cfg.block_m > 256:
    raise ValueError(f"{cfg}: {n_parts * cfg.row_tiles} fp32 accumulators of [64, {cfg.block_m}] per warpgroup "
                     "exceed 128 registers a thread")
  if cfg.k_splits > 1:
    out_dtype = jnp.float32
  out_itemsize = jnp.dtype(out_dtype).itemsize
  if (need := cfg.smem_bytes(n_parts, k, w.fmt, out_itemsize)) > SMEM_LIMIT_BYTES:
    raise NotImplementedError(f"{cfg} needs {need} bytes of SMEM (> {SMEM_LIMIT_BYTES})")
  m_pad = (meta.shape[0] - 1) * cfg.block_m if broadcast_lhs else lhs.shape[0]
  n = w.shape[1] // n_parts
  transposed = cfg.k_splits > 1 or jnp.dtype(out_dtype) == jnp.float32
  out_shape = (cfg.k_splits, n, m_pad) if transposed else (m_pad, n)
  if w.fmt == "nvfp4":
    lhs = nv_tiles.deinterleave_k(lhs)
  operands = [meta, lhs, w.values, kernel_scales(w, cfg.k_splits)]
  if w_shared is not None:
    operands += [w_shared.values, kernel_scales(w_shared, cfg.k_splits)]
  if w.fmt == "nvfp4":  # [E (+1), n_parts]: part p of expert e (row E: the shared expert's)
    gms = [part_multipliers(w.global_scale, n_parts)]
    if w_shared is not None:
      gms.append(part_multipliers(w_shared.global_scale[None], n_parts))
    operands.append(jnp.concatenate(gms) if len(gms) > 1 else gms[0])
  # The kernel body differs in the interpreter (no inline_mgpu); also when forced by force_gpu_interpret_mode.
  interp = bool(interpret) or _interpret_mode_forced()
  kernel = plgpu.kernel(
      functools.partial(_kernel, n_parts=n_parts, epilogue=epilogue, alpha=alpha, limit=limit, cfg=cfg,
                        broadcast_lhs=broadcast_lhs, fmt=w.fmt, has_shared=w_shared is not None,
                        interpret=interp),
      out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      interpret=interpret or None,
      kernel_name=(f"moe_grouped_{'w4a16' if w.fmt == 'nvfp4' else 'fp8'}_{w.fmt}_{epilogue}_bm{cfg.block_m}"
                   f"_bn{cfg.block_n}_ks{cfg.k_splits}"),
  )
  return kernel(*operands)
