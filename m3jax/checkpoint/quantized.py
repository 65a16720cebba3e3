"""Quantized weight formats of M3 checkpoints (M3_SPEC §6): config parsing, dequantization, and reference
quantizers (used by tests and benchmarks to build quantized fixtures from known weights).

Formats (per Linear ``X``; all matrices are [out, in]):
  * ``mxfp8``: ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` uint8 E8M0 [out, in/32];
    W = e4m3 * 2^(s - 127) (a multiplier despite the "_inv").
  * ``fp8_block``: ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` float (or E8M0) [ceil(out/bo), ceil(in/bi)],
    block (bo, bi) = (128, 128) by default; W = e4m3 * s[r // bo, c // bi].
  * ``nvfp4`` (compressed-tensors): ``X.weight_packed`` uint8 [out, in/2] (low nibble = even element; bit 3 = sign,
    bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), ``X.weight_scale`` float8_e4m3fn [out, in/16] and
    ``X.weight_global_scale`` fp32 (a divisor); W = e2m1 * (scale / global_scale). ``X.input_global_scale`` is an
    activation scale, unused for weight-only dequantization.
Dequantization is computed in fp32 (exact for every representable value) and cast by the caller.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import ml_dtypes
import numpy as np

Format = Literal["mxfp8", "fp8_block", "nvfp4"]

SCALE_INV = ".weight_scale_inv"
PACKED = ".weight_packed"
SCALE = ".weight_scale"
GLOBAL_SCALE = ".weight_global_scale"
INPUT_GLOBAL_SCALE = ".input_global_scale"
INPUT_SCALE = ".input_scale"
# Companion tensors that carry no weight data of their own (activation scales), ignored on load.
ACTIVATION_SUFFIXES = (INPUT_GLOBAL_SCALE, INPUT_SCALE)
QUANT_SUFFIXES = (SCALE_INV, PACKED, SCALE, GLOBAL_SCALE) + ACTIVATION_SUFFIXES

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
MX_BLOCK = 32
NVFP4_GROUP = 16
FP8_BLOCK = (128, 128)


class QuantError(ValueError):
  """A quantized tensor group that does not follow its format (the caller adds file and tensor names)."""


# quant_method -> the weight format it declares (M3_SPEC §6). Anything else is refused: a format is never guessed
# from the tensors.
METHODS: dict[str, Format] = {"mxfp8": "mxfp8", "fp8": "fp8_block", "compressed-tensors": "nvfp4"}
# Safetensors dtypes of the scales each fp8 format may store (E8M0 comes as U8 or F8_E8M0).
SCALE_DTYPES: dict[str, tuple[str, ...]] = {"mxfp8": ("U8", "F8_E8M0"), "fp8_block": ("F32", "U8", "F8_E8M0")}
E8M0_DTYPES = ("U8", "F8_E8M0")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """What config.json's ``quantization_config`` says.

  method: the ``quant_method`` string ('mxfp8', 'fp8', 'compressed-tensors'; others are refused).
  ignored: modules left unquantized (``ignored_layers`` / ``modules_to_not_convert`` / compressed-tensors ``ignore``).
  targets: compressed-tensors ``config_groups[*].targets`` (empty: every Linear).
  weight_block_size: FP8 block (rows, cols) when the config states it.
  """

  method: str
  ignored: tuple[str, ...] = ()
  targets: tuple[str, ...] = ()
  weight_block_size: tuple[int, int] | None = None

  @classmethod
  def from_config(cls, raw: Mapping[str, Any]) -> "QuantConfig | None":
    """From a whole config.json dict (top level or text_config); None for an unquantized checkpoint.

    QuantError for an unknown ``quant_method``, a compressed-tensors format other than NVFP4, or a block size
    that the method does not allow (mxfp8: 1 x 32 only)."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
      return None
    if not isinstance(q, Mapping):
      raise QuantError(f"config key 'quantization_config' must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in METHODS:
      raise QuantError(f"quantization_config: unknown quant_method {method!r}; m3jax reads "
                       f"{', '.join(repr(m) for m in METHODS)}")
    ignored: list[str] = []
    for key in ("ignored_layers", "modules_to_not_convert", "ignore"):
      ignored += list(q.get(key) or [])
    groups = q.get("config_groups") or {}
    targets: list[str] = []
    for group in groups.values():
      targets += list(group.get("targets") or [])
    if method == "compressed-tensors":
      formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, Mapping)}
      if "nvfp4-pack-quantized" not in formats:
        raise QuantError(f"quantization_config: compressed-tensors format {q.get('format')!r} is not supported; "
                         "m3jax reads 'nvfp4-pack-quantized'")
    block = q.get("weight_block_size")
    if block is not None:
      ok = (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))
      if not ok:
        raise QuantError(f"quantization_config: weight_block_size must be two positive integers, got {block!r}")
      if method == "mxfp8" and tuple(block) != (1, MX_BLOCK):
        raise QuantError(f"quantization_config: mxfp8 has blocks of [1, {MX_BLOCK}], got weight_block_size "
                         f"{list(block)}")
    return cls(method=str(method), ignored=tuple(ignored), targets=tuple(t for t in targets if t != "Linear"),
               weight_block_size=tuple(block) if block else None)

  @property
  def format(self) -> Format:
    """The weight format ``quant_method`` declares."""
    return METHODS[self.method]

  @property
  def block(self) -> tuple[int, int]:
    """(rows, cols) of one scale of an fp8 format: 1 x 32 for mxfp8, ``weight_block_size`` (default 128 x 128)
    for fp8."""
    if self.format == "mxfp8":
      return (1, MX_BLOCK)
    return self.weight_block_size or FP8_BLOCK

  def is_ignored(self, module: str) -> bool:
    return any(_module_matches(module, entry) for entry in self.ignored)

  def expects_quantized(self, module: str) -> bool:
    """True when the config quantizes Linear ``module`` (its weight is ``module + '.weight'``)."""
    if self.is_ignored(module):
      return False
    return not self.targets or any(_module_matches(module, t) for t in self.targets)


def _module_matches(module: str, entry: str) -> bool:
  """``re:<regex>`` (compressed-tensors; re.match) or a contiguous run of dotted name components, so that
  'lm_head', 'gate', 'block_sparse_moe.gate' and full names with or without a 'language_model.' prefix all work,
  while 'gate' does not match 'gate_proj'."""
  if entry.startswith("re:"):
    return re.match(entry[3:], module) is not None
  parts, want = module.split("."), entry.strip(".").split(".")
  return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def is_linear_weight(name: str, ndim: int) -> bool:
  """Tensors a Linear-quantizing config applies to: 2-D ``*.weight`` except embeddings."""
  return ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name


# ----------------------------------------------------------------------------------------------------------
# Dequantization (numpy, fp32 results)


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
  """uint8 E8M0 -> fp32 2^(s - 127) (255 is NaN)."""
  s = np.asarray(scale, np.uint8).astype(np.int32)
  out = np.ldexp(np.float32(1.0), s - 127).astype(np.float32)
  return np.where(s == 255, np.float32(np.nan), out)


def _scale_to_float(scale: np.ndarray) -> np.ndarray:
  if scale.dtype == np.uint8:
    return e8m0_to_float(scale)
  return np.asarray(scale, np.float32)


def scale_grid(weight_shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
  """The scales' shape of an fp8 weight [..., out, in] with ``block``: [..., ceil(out/bo), ceil(in/bi)]."""
  *lead, out, inp = weight_shape
  return (*lead, math.ceil(out / block[0]), math.ceil(inp / block[1]))


def dequantize_blocked(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """MXFP8 / FP8 block-scaled: e4m3 weight [..., out, in] * scale [..., g_out, g_in] per (bo, bi) block -> fp32."""
  bo, bi = block
  out, inp = weight.shape[-2:]
  s = _scale_to_float(scale)
  s = np.repeat(np.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inp]
  return weight.astype(np.float32) * s


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
  """uint8 [..., n/2] -> fp32 [..., n]; the low nibble is the even element."""
  packed = np.asarray(packed, np.uint8)
  codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
  mag = E2M1_VALUES[codes & 0x7]
  return np.where(codes & 0x8, -mag, mag).astype(np.float32)


def nvfp4_multiplier(global_scale: np.ndarray) -> np.ndarray:
  """compressed-tensors' ``weight_global_scale`` (a divisor) -> the fp32 multiplier 1 / g (one fp32 rounding, as
  vLLM inverts it on load)."""
  return (np.float32(1.0) / np.asarray(global_scale, np.float32)).astype(np.float32)


def dequantize_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
  """NVFP4: packed [..., out, in/2] uint8, scale [..., out, in/16] e4m3, global_scale (divisor) -> fp32 [..., out, in].

  W = (e2m1 * scale) * fl32(1 / global_scale): the first product is exact, the second rounds once in fp32, which
  is what ``pallas_kernels.quant.dequantize`` computes for the weight kept packed (bit for bit)."""
  values = unpack_e2m1(packed)
  inp = values.shape[-1]
  group = inp // scale.shape[-1]
  m = nvfp4_multiplier(global_scale)
  m = m.reshape(m.shape + (1,) * (values.ndim - m.ndim)) if m.ndim and m.size > 1 else m.reshape(())
  return (values * np.repeat(scale.astype(np.float32), group, axis=-1)[..., :inp]) * m


# ----------------------------------------------------------------------------------------------------------
# Reference quantizers (round to nearest; for tests, fixtures and benchmarks)


def quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """fp32 [..., out, in] -> (e4m3 [..., out, in], uint8 E8M0 [..., out, ceil(in/32)]); scale =
  2^ceil(log2(amax / 448)) per 32 inputs (a last partial block has its own scale). Bit-identical to
  ``pallas_kernels.quant.quantize(w, 'mxfp8')``."""
  *lead, out, inp = w.shape
  n_blocks = math.ceil(inp / MX_BLOCK)
  padded = np.zeros((*lead, out, n_blocks * MX_BLOCK), np.float32)
  padded[..., :inp] = w
  blocks = padded.reshape(*lead, out, n_blocks, MX_BLOCK)
  amax = np.abs(blocks).max(axis=-1)
  mant, e = np.frexp(amax / np.float32(448.0))  # exact ceil(log2(x)): e, or e - 1 where x is a power of two
  exp = np.where(amax > 0, e - (mant == 0.5), 0).astype(np.int32)
  exp = np.clip(exp, -127, 127)
  q = (blocks / np.ldexp(np.float32(1), exp)[..., None]).astype(ml_dtypes.float8_e4m3fn)
  return np.ascontiguousarray(q.reshape(*lead, out, -1)[..., :inp]), (exp + 127).astype(np.uint8)


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """fp32 [out, in] -> (e4m3 [out, in], fp32 scales [ceil(out/bo), ceil(in/bi)]), scale = amax / 448."""
  bo, bi = block
  out, inp = w.shape
  go, gi = math.ceil(out / bo), math.ceil(inp / bi)
  padded = np.zeros((go * bo, gi * bi), np.float32)
  padded[:out, :inp] = w
  amax = np.abs(padded.reshape(go, bo, gi, bi)).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
  full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:out, :inp]
  return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def quantize_nvfp4(w: np.ndarray, global_scale: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """fp32 [out, in] (in % 16 == 0) -> (packed uint8 [out, in/2], e4m3 scales [out, in/16], fp32 global divisor [1]).

  global_scale defaults to 448 * 6 / amax (the compressed-tensors choice), rounded to a power of two.
  """
  out, inp = w.shape
  if inp % NVFP4_GROUP:
    raise QuantError(f"NVFP4 needs in_features % {NVFP4_GROUP} == 0, got {w.shape}")
  w = w.astype(np.float32)
  if global_scale is None:
    amax = float(np.abs(w).max()) or 1.0
    global_scale = float(2.0 ** np.floor(np.log2(448.0 * 6.0 / amax)))
  groups = w.reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
  gmax = np.abs(groups).max(axis=-1)
  scale = (gmax / 6.0 * global_scale).astype(ml_dtypes.float8_e4m3fn)
  eff = scale.astype(np.float32) / np.float32(global_scale)
  x = np.where(eff[..., None] > 0, groups / np.where(eff > 0, eff, 1)[..., None], 0).reshape(out, inp)
  codes = np.abs(np.abs(x)[..., None] - E2M1_VALUES).argmin(axis=-1).astype(np.uint8)
  codes |= np.where(x < 0, 8, 0).astype(np.uint8)
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  return packed, scale, np.array([global_scale], np.float32)
