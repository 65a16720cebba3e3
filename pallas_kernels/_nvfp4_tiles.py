"""One packed NVFP4 weight tile, dequantized to bf16 inside a Mosaic GPU kernel: the W4A16 building block.

A consumer warpgroup owns 64 weight rows of a ``[64, 128]`` uint8 tile in SMEM (the checkpoint's packed bytes, as
TMA copied them with the fp8 tiles' 128-byte swizzle: ``_fp8_tiles.fp8_tile_transforms``), i.e. 256 inputs of
each row. Byte ``j`` holds input ``2j`` in its low nibble and ``2j + 1`` in its high nibble (M3_SPEC §6.3), so the
tile gives two bf16 wgmma ``A`` operands of the same ``[64, 128]`` shape and register layout as the bytes:

  ``lo[r, j] = W[r, 2j]`` (the low nibbles)  and  ``hi[r, j] = W[r, 2j + 1]`` (the high nibbles),

which multiply the even and the odd inputs of the step. The kernel's activations are permuted to match (per
256-input step: the 128 even inputs, then the 128 odd ones; ``deinterleave_k``), so the weights never move.
Column ``j`` of both halves reads the group scale ``j // 8`` of its row (inputs 2j, 2j + 1 share the group
(2j) // 16): in the WGMMA register layout that is the register's 8-column tile, one scale per (row, column tile).

Arithmetic (exact against ``pallas_kernels.quant.dequantize(w, bfloat16)``): each code is moved into an f16
(sign to bit 15, magnitude bits to 9..11: the E2M1 value times 2^-14 exactly, code 1 as an f16 subnormal),
widened to f32 (exact), multiplied by the e4m3 group scale times 2^14 (exact: at most 5 significant bits), then by
the row part's fp32 global multiplier (one fp32 rounding, as the reference's ``(e2m1 * s) * g``), and rounded
once to bf16.

As ``_fp8_tiles``: on the GPU an ``inline_mgpu`` routine of integer PTX (``prmt``, masks, shifts; the e4m3 scales
through ``cvt.rn.f16x2.e4m3x2``), in Pallas' GPU interpreter the same weights in fp32 jnp. The PTX bit moves are
emulated in numpy over every byte (tests/kernels/test_nvfp4_kernels.py); the compiled PTX still needs a GPU run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir

from pallas_kernels import _fp8_tiles as fp8_tiles
from pallas_kernels.quant import E2M1_VALUES, NVFP4_GROUP

ROWS = fp8_tiles.ROWS  # 64 weight rows per warpgroup (the wgmma M)
BYTES_K = fp8_tiles.BLOCK_K  # 128 packed bytes a row per step
BLOCK_K = 2 * BYTES_K  # 256 inputs per pipeline step
SCALES_PER_STEP = BLOCK_K // NVFP4_GROUP  # 16 e4m3 scales a row per step
COLS_PER_SCALE = NVFP4_GROUP // 2  # 8 byte columns (one WGMMA column tile) share a scale


def deinterleave_k(x: jax.Array) -> jax.Array:
  """Activations [M, K] (K % 256 == 0) -> the kernel's input order: per 256-input step, inputs 0, 2, .., 254,
  then 1, 3, .., 255 (what the low / high nibble halves of a packed tile multiply)."""
  m, k = x.shape
  return x.reshape(m, k // BLOCK_K, BYTES_K, 2).swapaxes(-1, -2).reshape(m, k)


# ---------------------------------------------------------------------------------------------------------------
# Interpreter (jnp) path


def dequant_jnp(packed: jax.Array, scales: jax.Array, gmul: jax.Array, half: int) -> jax.Array:
  """packed uint8 [R, 128], scales uint8 (e4m3 bits) [R, 16], gmul fp32 scalar -> bf16 [R, 128]: the low
  (``half`` 0) or high (1) nibbles' weights, (e2m1 * s) * g in fp32, one rounding."""
  codes = (packed & 0x0F) if half == 0 else (packed >> 4)
  mag = jnp.zeros(codes.shape, jnp.float32)
  for code, v in enumerate(E2M1_VALUES):  # scalar selects (a kernel body may close over scalars only)
    mag = jnp.where((codes & 0x7) == code, jnp.float32(v), mag)
  val = jnp.where((codes & 0x8) != 0, -mag, mag)
  s = jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
  s = jnp.repeat(s, COLS_PER_SCALE, axis=1)
  return ((val * s) * gmul.astype(jnp.float32)).astype(jnp.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# GPU (inline PTX) path

_I32 = lambda: ir.IntegerType.get_signless(32)
_F32 = lambda: ir.F32Type.get()

# Packed byte pair (16 bits: b0 | b1 << 8) -> bf16x2 {W(b0), W(b1)} of the low (or, after >> 4, high) nibbles:
#   x = [b0, 0, b1, 0] (prmt 0x4140: each byte at the bottom of its 16-bit lane) [>> 4 for the high nibbles];
#   h = ((x & 0x00080008) << 12) | ((x & 0x00070007) << 9): f16x2 {e2m1 * 2^-14}; widened to f32, times the
#   scale ($2 = s * 2^14), times the global multiplier ($3), rounded to bf16x2 (upper lane = b1).
_PAIR_PTX = """{{
.reg .b32 x, s, m;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
cvt.u32.u16 x, $1;
prmt.b32 x, x, 0, 0x4140;
{shift}
and.b32 s, x, 0x00080008;
and.b32 m, x, 0x00070007;
shl.b32 s, s, 12;
shl.b32 m, m, 9;
or.b32 x, s, m;
mov.b32 {{h0, h1}}, x;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
mul.rn.f32 f0, f0, $2;
mul.rn.f32 f1, f1, $2;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $3;
cvt.rn.bf16x2.f32 $0, f1, f0;
}}"""
_HIGH_SHIFT = "shr.b32 x, x, 4;"

# Four e4m3 scales (one 32-bit word, byte i = scale i) -> four f32 scales times 2^14.
_SCALES_PTX = """{
.reg .b16 lo, hi, a, b, c, d;
.reg .b32 h0, h1;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {a, b}, h0;
mov.b32 {c, d}, h1;
cvt.f32.f16 $0, a;
cvt.f32.f16 $1, b;
cvt.f32.f16 $2, c;
cvt.f32.f16 $3, d;
mul.rn.f32 $0, $0, 0f46800000;
mul.rn.f32 $1, $1, 0f46800000;
mul.rn.f32 $2, $2, 0f46800000;
mul.rn.f32 $3, $3, 0f46800000;
}"""


def dequant_gpu(values_ref, scales_ref, gmul: jax.Array, half: int) -> jax.Array:
  """values_ref: SMEM [64, 128] uint8 packed tile (fp8_tile_transforms); scales_ref: SMEM [64, 16] uint8 e4m3
  bits of the step (row-major, no transforms); gmul: fp32 scalar (the row part's global multiplier); half: 0 for
  the low nibbles (even inputs), 1 for the high ones -> bf16 [64, 128] in the WGMMA layout (a wgmma A operand)."""
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # pylint: disable=g-import-not-at-top

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(fp8_tiles.fp8_tile_transforms()), plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())),
      return_type=plgpu.ShapeDtypeStruct((ROWS, BYTES_K), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def body(_, values, scales, g):
    tile = mgpu.FragmentedArray.load_tiled(values, swizzle=128, is_signed=False, layout=mgpu.WGMMA_LAYOUT)
    g_reg = g.registers.item()
    f32 = _F32()
    scale = {}
    for h in range(2):
      row = fp8_tiles._thread_rows(h)  # pylint: disable=protected-access
      for w in range(SCALES_PER_STEP // 4):
        word = fp8_tiles._load_word(scales, row, _const(w), SCALES_PER_STEP)  # pylint: disable=protected-access
        four = mgpu_utils.inline_ptx(_SCALES_PTX, word, result_types=[f32] * 4)
        for i, s in enumerate(four):
          scale[h, 4 * w + i] = s
    ptx = _PAIR_PTX.format(shift=_HIGH_SHIFT if half else "")
    pieces = []
    for idx, pair in fp8_tiles._pairs(tile):  # pylint: disable=protected-access
      col_tile, row_half = idx[1], idx[4]  # registers: [1, 16 column tiles of 8, 1, 1, 2 row halves, 1, ...]
      word = mgpu_utils.inline_ptx(ptx, pair, scale[row_half, col_tile], g_reg, result_types=_I32())
      pieces.append((idx, word))
    return fp8_tiles._assemble(pieces, (ROWS, BYTES_K))  # pylint: disable=protected-access

  return body(values_ref, scales_ref, gmul)


def _const(v: int) -> ir.Value:
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  return mgpu.c(v, _I32())


# numpy emulation of the PTX bit moves (tests): byte -> the f16 bits of its low / high nibble's e2m1 * 2^-14.
def emulate_pair_bits(byte: np.ndarray, half: int) -> np.ndarray:
  """uint8 bytes -> uint16 f16 bits that ``_PAIR_PTX`` builds for the ``half`` nibble of each byte."""
  x = byte.astype(np.uint32)
  if half:
    x = x >> 4
  return ((((x & 0x8) << 12) | ((x & 0x7) << 9)) & 0xFFFF).astype(np.uint16)
