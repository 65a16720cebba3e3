"""Block-scaled fp8 weights as the kernels read them: ``QuantizedWeight`` and its pure-jnp reference ops.

A ``QuantizedWeight`` is a linear weight kept in a checkpoint's quantized form (M3_SPEC §6), in the
**checkpoint orientation** ``[..., out, in]`` (the reduction dim ``in`` is minor, i.e. "K-major": what
Hopper's fp8 wgmma needs for both operands, and what a TMA copy of the checkpoint bytes gives without a
transpose). Leading dims are batch dims (experts).

Formats:
  * ``mxfp8``: values float8_e4m3fn ``[..., out, in]``; scales uint8 E8M0 ``[..., out, ceil(in / 32)]``;
    W[r, c] = e4m3[r, c] * 2^(s[r, c // 32] - 127). Exact in bf16 unless the product leaves bf16's range.
  * ``fp8_block``: values float8_e4m3fn ``[..., out, in]``; scales float32 (or uint8 E8M0)
    ``[..., ceil(out / bo), ceil(in / bi)]`` with block (bo, bi), (128, 128) by default;
    W[r, c] = e4m3[r, c] * s[r // bo, c // bi].
  * ``nvfp4`` (compressed-tensors, M3_SPEC §6.3): values uint8 ``[..., out, in / 2]`` holding two E2M1 codes a
    byte (the low nibble is element 2j, the high nibble 2j + 1: the checkpoint's order; bit 3 is the sign, bits
    0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}); scales float8_e4m3fn ``[..., out, in / 16]`` (block (1, 16));
    ``global_scale`` fp32 ``[..., P]``: a **multiplier** per row part (the checkpoint's divisor inverted in fp32),
    rows [p * out / P, (p + 1) * out / P) use part p (gate_up: P = 2, the gate and up tensors' own scales).
    W[r, c] = (e2m1[r, c] * s[r, c // 16]) * g[r // (out / P)]: the first product is exact (at most 5
    significant bits), the second rounds once in fp32; ``dequantize`` computes exactly that.

Helpers that work on numpy and jax arrays alike (the checkpoint code uses them on host arrays): ``concat_out`` /
``split_out`` (weights stacked along ``out``, e.g. gate rows then up rows; fp8_block scales re-blocked where a part
ends inside a row block), ``quantize`` (the reference quantizers) and ``as_in_out`` (any weight as a dense
``[..., in, out]`` array, what the pure-jnp references multiply by).

This module depends on jax (and numpy) only. Checkpoint parsing lives in ``m3jax.checkpoint.quantized``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

WeightFormat = Literal["mxfp8", "fp8_block", "nvfp4"]
FORMATS: tuple[str, ...] = ("mxfp8", "fp8_block", "nvfp4")
MX_BLOCK = 32
FP8_BLOCK = (128, 128)
NVFP4_GROUP = 16
NVFP4_BLOCK = (1, NVFP4_GROUP)
VALUE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
PACKED_DTYPE = jnp.dtype(jnp.uint8)
NVFP4_SCALE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def scale_grid(weight_shape: tuple[int, ...], fmt: str, block: tuple[int, int]) -> tuple[int, ...]:
  """The scales' shape for values of ``weight_shape`` [..., out, in] in format ``fmt`` with ``block``."""
  *lead, out, inp = weight_shape
  bo, bi = block
  return (*lead, math.ceil(out / bo), math.ceil(inp / bi))


def default_block(fmt: str) -> tuple[int, int]:
  """(rows, cols) of one scale's block: (1, 32) for mxfp8, (128, 128) for fp8_block, (1, 16) for nvfp4."""
  if fmt == "mxfp8":
    return (1, MX_BLOCK)
  if fmt == "fp8_block":
    return FP8_BLOCK
  if fmt == "nvfp4":
    return NVFP4_BLOCK
  raise ValueError(f"unknown quantized weight format {fmt!r} (known: {', '.join(FORMATS)})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A quantized weight of logical shape ``[..., out, in]`` plus its block scales (see the module docstring).

  values: float8_e4m3fn [..., out, in] (mxfp8 / fp8_block) or uint8 [..., out, in / 2] (nvfp4, packed).
  scales: uint8 E8M0 (mxfp8; fp8_block may use it too) or float32 (fp8_block) [..., ceil(out/bo), ceil(in/bi)];
    float8_e4m3fn [..., out, in / 16] (nvfp4).
  fmt / block: static (pytree metadata), so jit specialises on them.
  global_scale: nvfp4 only (None otherwise): fp32 multipliers [..., P], P dividing out (one per row part).
  """

  values: jax.Array
  scales: jax.Array
  fmt: str = dataclasses.field(default="mxfp8", metadata=dict(static=True))
  block: tuple[int, int] = dataclasses.field(default=(1, MX_BLOCK), metadata=dict(static=True))
  global_scale: jax.Array | None = None

  def __post_init__(self):
    # Shapes are checked only on concrete-shaped leaves (jax transforms may build this with other leaves).
    values, scales = self.values, self.scales
    if not (hasattr(values, "shape") and hasattr(scales, "shape") and hasattr(values, "dtype")):
      return
    check_quantized(values.shape, values.dtype, scales.shape, scales.dtype, self.fmt, self.block, name="weight")
    g = self.global_scale
    if self.fmt != "nvfp4":
      if g is not None:
        raise ValueError(f"weight: only nvfp4 weights have a global scale, this one is {self.fmt}")
    elif hasattr(g, "shape") and hasattr(g, "dtype"):
      check_global_scale(values.shape, g.shape, g.dtype, name="weight")
    elif g is None:
      raise ValueError("weight: an nvfp4 weight needs its global_scale (fp32 [..., P])")

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical weight's shape [..., out, in]."""
    return logical_shape(tuple(self.values.shape), self.fmt)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  @property
  def parts(self) -> int:
    """Row parts with their own global scale (nvfp4; 1 for the fp8 formats)."""
    return 1 if self.global_scale is None else int(self.global_scale.shape[-1])

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The weight as ``dtype`` [..., out, in] (computed in fp32, exact for every representable value)."""
    return dequantize(self, dtype)


def logical_shape(values_shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
  """The weight's [..., out, in] from its stored values' shape (nvfp4 packs two inputs a byte)."""
  if fmt == "nvfp4":
    return (*values_shape[:-1], 2 * values_shape[-1])
  return tuple(values_shape)


def values_shape_of(weight_shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
  """The stored values' shape of a weight [..., out, in] in ``fmt`` (nvfp4: [..., out, in / 2])."""
  if fmt == "nvfp4":
    return (*weight_shape[:-1], weight_shape[-1] // 2)
  return tuple(weight_shape)


def check_global_scale(values_shape, g_shape, g_dtype, *, name: str) -> None:
  """ValueError unless an nvfp4 global scale is fp32 [..., P] with the values' leading dims and P dividing out."""
  lead, out = tuple(values_shape[:-2]), values_shape[-2]
  if jnp.dtype(g_dtype) != jnp.float32:
    raise ValueError(f"{name}: nvfp4 global scale must be float32, got {jnp.dtype(g_dtype).name}")
  if len(g_shape) != len(lead) + 1 or tuple(g_shape[:-1]) != lead or g_shape[-1] < 1 or out % g_shape[-1]:
    raise ValueError(f"{name}: nvfp4 global scale for values {list(values_shape)} must be [{', '.join(map(str, lead))}"
                     f"{', ' if lead else ''}P] with P dividing {out}, got {list(g_shape)}")


def _check_nvfp4(values_shape, values_dtype, scales_shape, scales_dtype, block, *, name: str) -> None:
  if tuple(block) != NVFP4_BLOCK:
    raise ValueError(f"{name}: nvfp4 has blocks of {NVFP4_BLOCK}, got {tuple(block)}")
  if jnp.dtype(values_dtype) != PACKED_DTYPE:
    raise ValueError(f"{name}: nvfp4 values must be uint8 (two E2M1 codes a byte), got {jnp.dtype(values_dtype).name}")
  if len(values_shape) < 2:
    raise ValueError(f"{name}: quantized values must be [..., out, in / 2], got shape {list(values_shape)}")
  if jnp.dtype(scales_dtype) != NVFP4_SCALE_DTYPE:
    raise ValueError(f"{name}: nvfp4 scales must be float8_e4m3fn, got {jnp.dtype(scales_dtype).name}")
  inp = 2 * values_shape[-1]
  want = (*values_shape[:-1], inp // NVFP4_GROUP)
  if inp % NVFP4_GROUP or tuple(scales_shape) != want:
    raise ValueError(f"{name}: nvfp4 scales for packed values {list(values_shape)} (in = {inp}, one scale per "
                     f"{NVFP4_GROUP}) must be {list(want)}, got {list(scales_shape)}")


def check_quantized(values_shape, values_dtype, scales_shape, scales_dtype, fmt: str, block: tuple[int, int],
                    *, name: str) -> None:
  """ValueError naming ``name`` and both shapes unless values / scales are exactly what ``fmt`` implies."""
  if fmt not in FORMATS:
    raise ValueError(f"{name}: unknown quantized weight format {fmt!r} (known: {', '.join(FORMATS)})")
  if fmt == "nvfp4":
    _check_nvfp4(values_shape, values_dtype, scales_shape, scales_dtype, block, name=name)
    return
  if fmt == "mxfp8" and tuple(block) != (1, MX_BLOCK):
    raise ValueError(f"{name}: mxfp8 has blocks of (1, {MX_BLOCK}), got {tuple(block)}")
  if jnp.dtype(values_dtype) != VALUE_DTYPE:
    raise ValueError(f"{name}: quantized values must be float8_e4m3fn, got {jnp.dtype(values_dtype).name}")
  if len(values_shape) < 2:
    raise ValueError(f"{name}: quantized values must be [..., out, in], got shape {list(values_shape)}")
  sdt = jnp.dtype(scales_dtype)
  allowed = (jnp.dtype(jnp.uint8),) if fmt == "mxfp8" else (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32))
  if sdt not in allowed:
    raise ValueError(f"{name}: {fmt} scales must be {' or '.join(d.name for d in allowed)}, got {sdt.name}")
  want = scale_grid(tuple(values_shape), fmt, tuple(block))
  if tuple(scales_shape) != want:
    raise ValueError(f"{name}: {fmt} scales for values {list(values_shape)} (block {tuple(block)}) must be "
                     f"{list(want)}, got {list(scales_shape)}")


def scales_to_float(scales: jax.Array) -> jax.Array:
  """uint8 E8M0 -> fp32 2^(s - 127) (255 is NaN); float scales -> fp32."""
  if scales.dtype == jnp.uint8:
    s = scales.astype(jnp.int32)
    out = jnp.ldexp(jnp.float32(1.0), s - 127)
    return jnp.where(s == 255, jnp.float32(jnp.nan), out)
  return scales.astype(jnp.float32)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
  """uint8 [..., n] -> fp32 [..., 2n] E2M1 values (the low nibble is the even element)."""
  codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
  mag = jnp.asarray(E2M1_VALUES, jnp.float32)[(codes & 0x7).astype(jnp.int32)]
  return jnp.where((codes & 0x8) != 0, -mag, mag)


def row_global_scales(global_scale: jax.Array, out: int) -> jax.Array:
  """fp32 [..., P] part multipliers -> [..., out] one per row."""
  return jnp.repeat(global_scale.astype(jnp.float32), out // global_scale.shape[-1], axis=-1)


def dequantize_nvfp4(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference of an nvfp4 weight: (e2m1 * scale) * global, in fp32 (the first product exact, one fp32
  rounding), then one rounding to ``dtype`` -> [..., out, in]."""
  vals = unpack_e2m1(w.values)
  s = jnp.repeat(w.scales.astype(jnp.float32), NVFP4_GROUP, axis=-1)
  g = row_global_scales(w.global_scale, vals.shape[-2])[..., None]
  return ((vals * s) * g).astype(dtype)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference: ``w`` as ``dtype`` [..., out, in] (fp32 math, one rounding to ``dtype``)."""
  if w.fmt == "nvfp4":
    return dequantize_nvfp4(w, dtype)
  bo, bi = w.block
  out, inp = w.values.shape[-2:]
  s = scales_to_float(w.scales)
  s = jnp.repeat(jnp.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inp]
  return (w.values.astype(jnp.float32) * s).astype(dtype)


def as_in_out(w: Any, dtype) -> jax.Array:
  """A dense weight ``[..., in, out]`` in ``dtype``: an array is cast as it is (it already has that layout); a
  ``QuantizedWeight`` [..., out, in] is dequantized (fp32 math, one rounding to ``dtype``) and transposed."""
  if isinstance(w, QuantizedWeight):
    return jnp.swapaxes(dequantize(w, dtype), -1, -2)
  return w.astype(dtype)


def _xp(a):
  """numpy for host arrays, jax.numpy otherwise."""
  return np if isinstance(a, np.ndarray) else jnp


def concat_block(out_sizes: Sequence[int], fmt: str, block: tuple[int, int]) -> tuple[int, int]:
  """The block of the scales of weights [out_i, in] (each with ``block``) concatenated along ``out``.

  Unchanged when every part but the last spans whole row blocks (always for mxfp8: rows of 1). Otherwise
  (fp8_block parts that end inside a row block, e.g. a 32-row gate under 128-row blocks) the rows shrink to
  g = gcd(block rows, every part's rows but the last's): each block of rows then starts on a multiple of g, and
  each part's scale rows are repeated block_rows / g times, so the concatenation is exact.
  """
  bo, bi = block
  inner = [int(o) for o in out_sizes[:-1]]
  if fmt == "mxfp8" or all(o % bo == 0 for o in inner):
    return (bo, bi)
  return (math.gcd(bo, *inner), bi)


def reblock_rows(scales, out: int, block: tuple[int, int], rows: int):
  """Scales [..., ceil(out/bo), g_in] of ``out`` weight rows in blocks of bo = block[0] -> the same scales in
  blocks of ``rows`` rows (``rows`` divides bo): [..., ceil(out/rows), g_in], each row repeated bo/rows times."""
  bo = block[0]
  if bo % rows:
    raise ValueError(f"cannot re-block scales of {bo}-row blocks into {rows}-row blocks")
  xp = _xp(scales)
  return xp.repeat(scales, bo // rows, axis=-2)[..., :math.ceil(out / rows), :]


def unblock_rows(scales, out: int, rows: int, block: tuple[int, int]):
  """Inverse of ``reblock_rows``: scales in ``rows``-row blocks -> [..., ceil(out/bo), g_in] (every (bo/rows)-th
  row; the rows in between are the copies ``reblock_rows`` made)."""
  bo = block[0]
  return scales[..., :: bo // rows, :][..., :math.ceil(out / bo), :]


def concat_out(parts: Sequence[tuple[Any, Any]], fmt: str, block: tuple[int, int]) -> tuple[Any, Any, tuple[int, int]]:
  """(values, scales) pairs [..., out_i, in] (same leading dims and ``in``, each with ``block``) -> their
  concatenation along ``out``: (values [..., sum out_i, in], scales, block of the result; see ``concat_block``)."""
  out_sizes = [v.shape[-2] for v, _ in parts]
  new = concat_block(out_sizes, fmt, block)
  xp = _xp(parts[0][0])
  scales = [s if new == tuple(block) else reblock_rows(s, o, block, new[0]) for (_, s), o in zip(parts, out_sizes)]
  values = parts[0][0] if len(parts) == 1 else xp.concatenate([v for v, _ in parts], axis=-2)
  return values, (scales[0] if len(scales) == 1 else xp.concatenate(scales, axis=-2)), new


def split_out(values, scales, out_sizes: Sequence[int], block: tuple[int, int], part_block: tuple[int, int]
              ) -> list[tuple[Any, Any]]:
  """Inverse of ``concat_out``: values [..., sum out_i, in] and scales in ``block`` -> one (values, scales) pair
  per part, with scales in ``part_block`` (the parts' own block)."""
  out, vstart, sstart = [], 0, 0
  rows = block[0]
  for o in out_sizes:
    n_rows = math.ceil(o / rows)
    v, s = values[..., vstart:vstart + o, :], scales[..., sstart:sstart + n_rows, :]
    if tuple(block) != tuple(part_block):
      s = unblock_rows(s, o, rows, part_block)
    out.append((v, s))
    vstart, sstart = vstart + o, sstart + n_rows
  return out


def _quantize_nvfp4(w: jax.Array, parts: int) -> QuantizedWeight:
  """nvfp4 reference quantizer (see ``quantize``)."""
  *lead, out, inp = w.shape
  if inp % NVFP4_GROUP or out % parts:
    raise ValueError(f"quantize: nvfp4 needs in % {NVFP4_GROUP} == 0 and out % parts == 0, got {w.shape}, {parts=}")
  w = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w.reshape(*lead, parts, out // parts * inp)), axis=-1)
  _, e = jnp.frexp(jnp.float32(448.0 * 6.0) / jnp.where(amax > 0, amax, 1.0))
  divisor = jnp.ldexp(jnp.float32(1.0), e - 1)  # 2^floor(log2(448 * 6 / amax)), as quantized.quantize_nvfp4
  row_div = jnp.repeat(divisor, out // parts, axis=-1)[..., None, None]  # [..., out, 1, 1]
  groups = w.reshape(*lead, out, inp // NVFP4_GROUP, NVFP4_GROUP)
  gmax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
  scales = (gmax / 6.0 * row_div).astype(NVFP4_SCALE_DTYPE)
  eff = scales.astype(jnp.float32) / row_div
  x = jnp.where(eff > 0, groups / jnp.where(eff > 0, eff, 1.0), 0.0).reshape(*lead, out, inp)
  table = jnp.asarray(E2M1_VALUES, jnp.float32)
  codes = jnp.argmin(jnp.abs(jnp.abs(x)[..., None] - table), axis=-1).astype(jnp.uint8)
  codes = codes | jnp.where(x < 0, 8, 0).astype(jnp.uint8)
  packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
  return QuantizedWeight(packed, scales[..., 0], "nvfp4", NVFP4_BLOCK, (1.0 / divisor).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "block", "scale_dtype", "parts"))
def quantize(w: jax.Array, fmt: str, block: tuple[int, int] | None = None, scale_dtype=None,
             parts: int = 1) -> QuantizedWeight:
  """Reference quantizer (round to nearest): a float weight [..., out, in] -> ``QuantizedWeight``.

  mxfp8: one E8M0 scale per 32 inputs, 2^ceil(log2(amax / 448)) (a last partial block has its own scale).
  fp8_block: scales amax / 448 per ``block`` (default 128 x 128), float32 (or E8M0 powers of two rounded up,
  with ``scale_dtype=uint8``). An all-zero block gets the scale 1 (E8M0 127).
  nvfp4: per row part (``parts`` of out, e.g. 2 for gate_up) a power-of-two global divisor
  2^floor(log2(448 * 6 / amax)) (kept as its exact inverse), e4m3 scales amax16 / 6 * divisor per 16 inputs,
  E2M1 codes rounded to nearest (ties to the smaller magnitude), as ``m3jax.checkpoint.quantized.quantize_nvfp4``.
  """
  if fmt == "nvfp4":
    return _quantize_nvfp4(w, parts)
  block = tuple(block or default_block(fmt))
  check_quantized(w.shape, VALUE_DTYPE, scale_grid(w.shape, fmt, block), jnp.uint8 if fmt == "mxfp8" else
                  (scale_dtype or jnp.float32), fmt, block, name="quantize")
  *lead, out, inp = w.shape
  bo, bi = block
  go, gi = math.ceil(out / bo), math.ceil(inp / bi)
  w = w.astype(jnp.float32)
  padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, go * bo - out), (0, gi * bi - inp)])
  amax = jnp.max(jnp.abs(padded.reshape(*lead, go, bo, gi, bi)), axis=(-3, -1))
  e8m0 = fmt == "mxfp8" or jnp.dtype(scale_dtype or jnp.float32) == jnp.uint8
  if e8m0:
    mant, e = jnp.frexp(amax / jnp.float32(448.0))  # exact ceil(log2(x)): e, or e - 1 where x is a power of two
    exp = jnp.clip(jnp.where(amax > 0, e - (mant == 0.5), 0), -127, 127).astype(jnp.int32)
    scales = (exp + 127).astype(jnp.uint8)
    step = jnp.ldexp(jnp.float32(1.0), exp)
  else:
    step = scales = jnp.where(amax > 0, amax / 448.0, 1.0).astype(jnp.float32)
  full = jnp.repeat(jnp.repeat(step, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inp]
  return QuantizedWeight((w / full).astype(VALUE_DTYPE), scales, fmt, block)


# E8M0 codes the fp8 kernels dequantize exactly (pallas_kernels._fp8_tiles: a bf16 2^(s - 7) multiplier).
KERNEL_MAX_E8M0 = 134


def kernel_scale_range_ok(w: QuantizedWeight) -> jax.Array:
  """bool scalar: whether the fp8 kernels take ``w`` exactly. mxfp8 codes must be <= 134 (block scales <= 2^7,
  i.e. weights within +-57344; real checkpoints sit near 2^-10); fp8_block always qualifies. A loader checks a
  weight once; the kernels do not re-check per call (it would read every scale)."""
  if w.fmt != "mxfp8":
    return jnp.array(True)
  return jnp.max(w.scales) <= KERNEL_MAX_E8M0
