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

This module depends on jax only. The numpy quantizers / loaders live in ``m3jax.checkpoint.quantized``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

WeightFormat = Literal["mxfp8", "fp8_block"]
FORMATS: tuple[str, ...] = ("mxfp8", "fp8_block")
MX_BLOCK = 32
FP8_BLOCK = (128, 128)
VALUE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def scale_grid(weight_shape: tuple[int, ...], fmt: str, block: tuple[int, int]) -> tuple[int, ...]:
  """The scales' shape for values of ``weight_shape`` [..., out, in] in format ``fmt`` with ``block``."""
  *lead, out, inp = weight_shape
  bo, bi = block
  return (*lead, math.ceil(out / bo), math.ceil(inp / bi))


def default_block(fmt: str) -> tuple[int, int]:
  """(rows, cols) of one scale's block: (1, 32) for mxfp8, (128, 128) for fp8_block."""
  if fmt == "mxfp8":
    return (1, MX_BLOCK)
  if fmt == "fp8_block":
    return FP8_BLOCK
  raise ValueError(f"unknown quantized weight format {fmt!r} (known: {', '.join(FORMATS)})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """An fp8 weight ``[..., out, in]`` plus its block scales (see the module docstring).

  values: float8_e4m3fn [..., out, in].
  scales: uint8 E8M0 (mxfp8; fp8_block may use it too) or float32 (fp8_block) [..., ceil(out/bo), ceil(in/bi)].
  fmt / block: static (pytree metadata), so jit specialises on them.
  """

  values: jax.Array
  scales: jax.Array
  fmt: str = dataclasses.field(default="mxfp8", metadata=dict(static=True))
  block: tuple[int, int] = dataclasses.field(default=(1, MX_BLOCK), metadata=dict(static=True))

  def __post_init__(self):
    # Shapes are checked only on concrete-shaped leaves (jax transforms may build this with other leaves).
    values, scales = self.values, self.scales
    if not (hasattr(values, "shape") and hasattr(scales, "shape") and hasattr(values, "dtype")):
      return
    check_quantized(values.shape, values.dtype, scales.shape, scales.dtype, self.fmt, self.block, name="weight")

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical weight's shape [..., out, in]."""
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.values.shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The weight as ``dtype`` [..., out, in] (computed in fp32, exact for every representable value)."""
    return dequantize(self, dtype)


def check_quantized(values_shape, values_dtype, scales_shape, scales_dtype, fmt: str, block: tuple[int, int],
                    *, name: str) -> None:
  """ValueError naming ``name`` and both shapes unless values / scales are exactly what ``fmt`` implies."""
  if fmt not in FORMATS:
    raise ValueError(f"{name}: unknown quantized weight format {fmt!r} (known: {', '.join(FORMATS)})")
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


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
  """Pure-jnp reference: ``w`` as ``dtype`` [..., out, in] (fp32 math, one rounding to ``dtype``)."""
  bo, bi = w.block
  out, inp = w.values.shape[-2:]
  s = scales_to_float(w.scales)
  s = jnp.repeat(jnp.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inp]
  return (w.values.astype(jnp.float32) * s).astype(dtype)


# E8M0 codes the fp8 kernels dequantize exactly (pallas_kernels._fp8_tiles: a bf16 2^(s - 7) multiplier).
KERNEL_MAX_E8M0 = 134


def kernel_scale_range_ok(w: QuantizedWeight) -> jax.Array:
  """bool scalar: whether the fp8 kernels take ``w`` exactly. mxfp8 codes must be <= 134 (block scales <= 2^7,
  i.e. weights within +-57344; real checkpoints sit near 2^-10); fp8_block always qualifies. A loader checks a
  weight once; the kernels do not re-check per call (it would read every scale)."""
  if w.fmt != "mxfp8":
    return jnp.array(True)
  return jnp.max(w.scales) <= KERNEL_MAX_E8M0
