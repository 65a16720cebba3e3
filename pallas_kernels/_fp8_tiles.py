"""One fp8 weight tile, dequantized to bf16 inside a Mosaic GPU kernel: the W8A16 building block.

A consumer warpgroup owns 64 weight rows (output features) of a ``[64, 128]`` float8_e4m3fn tile in SMEM (the
checkpoint's K-major orientation, as TMA copied it) and turns it into the bf16 ``A`` operand of a wgmma
(``[64 rows, 128 K]`` in the WGMMA register layout), so the weights cross HBM as 1 byte each and multiply on the
bf16 tensor cores. Both formats are exact against ``pallas_kernels.quant.dequantize(w, bfloat16)``:

* ``mxfp8`` (one E8M0 code ``s`` per row and 32 inputs): the e4m3 bits are moved into a bf16 (sign to bit 15,
  exponent and mantissa to bits 4..10), which is the e4m3 value times 2^-120 exactly (subnormals too), then one
  bf16 multiply by 2^(s - 7) = 2^(s - 127) * 2^120 gives the weight, rounded once (as the reference rounds its
  fp32 product). The 2^(s - 7) pair is built from the code's bits: ``(s + 120) << 7``. Codes above 134 (block
  scales above 2^7, weights beyond 57344 in magnitude) do not fit that bf16 and are outside the kernels' domain:
  ``pallas_kernels.quant.kernel_scale_range_ok`` checks a weight once, at load time.
* ``fp8_block`` (one fp32 scale per 128 x 128 block): e4m3 -> f16 -> f32 (exact), times the scale in fp32, one
  rounding to bf16, which is what the reference computes.

Two implementations with one contract: on the GPU an ``inline_mgpu`` routine of integer PTX (``prmt``, shifts,
``lop3``, ``mul.bf16x2``: no e4m3 -> bf16 ``cvt`` exists before PTX ISA 9.2), and in Pallas' GPU interpreter
(which cannot run ``inline_mgpu``) the same weights computed in fp32 jnp. The interpreter therefore checks the
kernels' tiling, indexing and scale addressing; the PTX's bit arithmetic is checked by a numpy emulation of it
over every code (tests/kernels/test_fp8_kernels.py) and, compiled, by the ``gpu`` kernel tests (an identity
matmul that must return the dequantized weight bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm

ROWS = 64  # weight rows per warpgroup (the wgmma M)
BLOCK_K = 128  # K per pipeline step: one 128-byte swizzle row of fp8
MX_BLOCK = 32
MX_PER_STEP = BLOCK_K // MX_BLOCK  # E8M0 codes per row and step: one 32-bit word


def fp8_tile_transforms() -> tuple:
  """SMEM transforms of a [rows, 128] fp8 tile: (8, 128) tiles, 128-byte swizzle."""
  return (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))


def bf16_tile_transforms(minor: int) -> tuple:
  """SMEM transforms of a bf16 tile with ``minor`` columns (128-byte swizzle when it fits)."""
  swizzle = plgpu.find_swizzle(minor * 16)
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


# ---------------------------------------------------------------------------------------------------------------
# Interpreter (jnp) path


def dequant_mx_jnp(values: jax.Array, codes: jax.Array) -> jax.Array:
  """values float8_e4m3fn [R, 128], codes uint8 [R, 4] -> bf16 [R, 128]: the weight the PTX path computes
  (e4m3 * 2^(s - 127), one rounding), in fp32 jnp (the PTX's intermediate e4m3 * 2^-120 is subnormal for small
  codes, which XLA:CPU would flush)."""
  scale = jnp.ldexp(jnp.float32(1.0), codes.astype(jnp.int32) - 127)
  return (values.astype(jnp.float32) * jnp.repeat(scale, MX_BLOCK, axis=1)).astype(jnp.bfloat16)


def dequant_block_jnp(values: jax.Array, scale: jax.Array) -> jax.Array:
  """values float8_e4m3fn [R, 128], one fp32 scale -> bf16 [R, 128] (fp32 product, one rounding)."""
  return (values.astype(jnp.float32) * scale.astype(jnp.float32)).astype(jnp.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# GPU (inline PTX) path

_I32 = lambda: ir.IntegerType.get_signless(32)
_I16 = lambda: ir.IntegerType.get_signless(16)

# e4m3 pair (16 bits: b0 | b1 << 8) -> bf16x2 {b0, b1} * 2^-120, then times the scale pair:
#   t = [0, b0, 0, b1] (each byte in the high byte of its 16-bit lane: sign at bit 15);
#   m = (t >> 4) & 0x07F007F0 (exponent + mantissa to bits 4..10); r = (t & 0x80008000) | m (lop3 0xEC).
_MX_PAIR_PTX = """{
.reg .b32 t, m;
cvt.u32.u16 t, $1;
prmt.b32 t, t, 0, 0x1404;
shr.b32 m, t, 4;
and.b32 m, m, 0x07F007F0;
lop3.b32 t, t, m, 0x80008000, 0xEC;
mul.rn.bf16x2 $0, t, $2;
}"""

# E8M0 code j of a 32-bit word (4 codes) -> bf16x2 {2^(s-7), 2^(s-7)}: lanes [s, 0, s, 0], + 120, << 7.
_MX_SCALE_PTX = """{{
.reg .b32 t;
prmt.b32 t, $1, 0, {sel};
add.u32 t, t, 0x00780078;
shl.b32 $0, t, 7;
}}"""

# e4m3 pair -> f16x2 -> two f32, times the fp32 scale, -> bf16x2 (one rounding each).
_BLOCK_PAIR_PTX = """{
.reg .b32 h;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
cvt.rn.f16x2.e4m3x2 h, $1;
mov.b32 {h0, h1}, h;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
mul.rn.f32 f0, f0, $2;
mul.rn.f32 f1, f1, $2;
cvt.rn.bf16x2.f32 $0, f1, f0;
}"""


def _thread_rows(h: int):
  """Row (within the warpgroup's 64) that this thread holds in WGMMA-layout row half ``h`` (0: +0, 1: +8)."""
  i32 = _I32()
  tid = mgpu_utils.thread_idx()
  lane = arith.remui(tid, mgpu.c(32, i32))
  warp = arith.remui(arith.divui(tid, mgpu.c(32, i32)), mgpu.c(4, i32))
  row = arith.addi(arith.muli(warp, mgpu.c(16, i32)), arith.divui(lane, mgpu.c(4, i32)))
  return arith.addi(row, mgpu.c(8 * h, i32))


def _load_word(codes_ref: ir.Value, row: ir.Value, ki: ir.Value, row_bytes: int) -> ir.Value:
  """The 32-bit word of codes at byte row * row_bytes + 4 * ki of a contiguous SMEM group (4-byte aligned)."""
  i32, i64 = _I32(), ir.IntegerType.get_signless(64)
  base = mgpu_utils.memref_ptr(codes_ref)
  offset = arith.addi(arith.muli(row, mgpu.c(row_bytes, i32)), arith.muli(ki, mgpu.c(4, i32)))
  ptr = mgpu_utils.getelementptr(base, [arith.extui(i64, offset)], ir.IntegerType.get_signless(8))
  return llvm.load(i32, ptr, alignment=4)


def _pairs(tile: mgpu.FragmentedArray):
  """(register index, 16-bit e4m3 pair) of a [64, 128] fp8 array in the WGMMA layout."""
  i16 = _I16()
  for idx, reg in np.ndenumerate(tile.registers):
    yield idx, mgpu_utils.bitcast(reg, i16)


def _assemble(pieces, shape) -> mgpu.FragmentedArray:
  bf16 = ir.BF16Type.get()
  regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
  for idx, word in pieces:
    regs[idx] = mgpu_utils.bitcast(word, ir.VectorType.get((2,), bf16))
  return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


def _load_tile(values_ref: ir.Value) -> mgpu.FragmentedArray:
  """The [64, 128] fp8 tile of a tiled, 128-byte swizzled SMEM ref, in the WGMMA layout (2 bytes a register)."""
  return mgpu.FragmentedArray.load_tiled(values_ref, swizzle=128, layout=mgpu.WGMMA_LAYOUT)


def dequant_mx_gpu(values_ref, codes_ref, ki: jax.Array, row_bytes: int) -> jax.Array:
  """values_ref: SMEM [64, 128] fp8 tile (fp8_tile_transforms); codes_ref: this warpgroup's contiguous SMEM group
  of E8M0 codes (64 rows of ``row_bytes``: the item's K range / 32); ki: int32 step (codes 4 ki .. 4 ki + 3 of a
  row) -> bf16 [64, 128] in the WGMMA layout (the wgmma A operand)."""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(fp8_tile_transforms()), plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())),
      return_type=plgpu.ShapeDtypeStruct((ROWS, BLOCK_K), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def body(_, values, codes, step):
    tile = _load_tile(values)
    i32 = _I32()
    step_reg = step.registers.item()
    words = [_load_word(codes, _thread_rows(h), step_reg, row_bytes) for h in range(2)]
    scales = {}
    for h in range(2):
      for j in range(MX_PER_STEP):
        sel = 0x4040 | (j << 8) | j
        scales[h, j] = mgpu_utils.inline_ptx(_MX_SCALE_PTX.format(sel=hex(sel)), words[h], result_types=i32)
    pieces = []
    for idx, pair in _pairs(tile):
      col_tile, half = idx[1], idx[4]  # registers: [1, 16 column tiles of 8, 1, 1, 2 row halves, 1, ...]
      word = mgpu_utils.inline_ptx(_MX_PAIR_PTX, pair, scales[half, col_tile // 4], result_types=i32)
      pieces.append((idx, word))
    return _assemble(pieces, (ROWS, BLOCK_K))

  return body(values_ref, codes_ref, ki)


def codes_for_step(group: jax.Array, ki: jax.Array, row_bytes: int) -> jax.Array:
  """uint8 [64, 4]: the E8M0 codes of step ki from a group's contiguous codes (any shape, 64 * row_bytes)."""
  rows = group.reshape(ROWS, row_bytes)
  return lax.dynamic_slice_in_dim(rows, ki * MX_PER_STEP, MX_PER_STEP, axis=1)


def dequant_block_gpu(values_ref, scale: jax.Array) -> jax.Array:
  """values_ref: SMEM [64, 128] fp8 tile; scale: fp32 scalar (this 128 x 128 block's) -> bf16 [64, 128] WGMMA."""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(fp8_tile_transforms()), plgpu.Layout.WG_SPLAT(shape=())),
      return_type=plgpu.ShapeDtypeStruct((ROWS, BLOCK_K), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def body(_, values, s):
    tile = _load_tile(values)
    s_reg = s.registers.item()
    i32 = _I32()
    pieces = [(idx, mgpu_utils.inline_ptx(_BLOCK_PAIR_PTX, pair, s_reg, result_types=i32))
              for idx, pair in _pairs(tile)]
    return _assemble(pieces, (ROWS, BLOCK_K))

  return body(values_ref, scale)
