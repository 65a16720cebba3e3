"""Logical tensors of a safetensors checkpoint: each quantized Linear appears as one dequantized ``X.weight``.

``TensorSource`` has the read interface of ``SafetensorsDir`` (keys / shape / dtype / file_of / get) over logical
names, plus row-range reads (stacked experts) and a check that the checkpoint's quantization matches its config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from m3jax.checkpoint import quantized as q
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES, read_tensor

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class TensorSource:
  """Logical tensor name -> (shape, dtype) for a checkpoint directory, dequantizing on read.

  Args:
    ckpt: the physical tensors.
    quant: the config's quantization (None: the checkpoint must not contain quantized tensors).
  """

  def __init__(self, ckpt: SafetensorsDir, quant: q.QuantConfig | None):
    self.ckpt, self.quant, self.path = ckpt, quant, ckpt.path
    self._format: dict[str, q.Format] = {}  # logical name -> format (quantized only)
    self._parts: dict[str, tuple[str, ...]] = {}  # logical name -> physical tensors it reads
    self._shape: dict[str, tuple[int, ...]] = {}
    self._dtype: dict[str, str] = {}
    self._blocks: dict[str, tuple[int, int]] = {}  # fp8 logical name -> (rows, cols) scale block
    self.activation_scales: list[str] = []
    names = set(ckpt.keys())
    claimed: set[str] = set()
    for name in sorted(names):
      if name.endswith(q.SCALE_INV):
        base = name[: -len(q.SCALE_INV)]
        self._add_fp8(base + ".weight", name, names)
        claimed |= {name, base + ".weight"}
      elif name.endswith(q.PACKED):
        base = name[: -len(q.PACKED)]
        self._add_nvfp4(base, names)
        claimed |= set(self._parts[base + ".weight"])
    for name in sorted(names - claimed):
      if name.endswith(q.ACTIVATION_SUFFIXES):
        self.activation_scales.append(name)
        continue
      if name.endswith(q.QUANT_SUFFIXES):
        raise CheckpointError(f"{self._where(name)}: quantization tensor {name!r} has no weight it belongs to")
      self._parts[name] = (name,)
      self._shape[name] = ckpt.shape(name)
      self._dtype[name] = ckpt.dtype(name)

  @classmethod
  def open(cls, path: str | os.PathLike) -> "TensorSource":
    """Reads ``path``/config.json's quantization_config and indexes the safetensors files."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
      raw = json.load(f)
    try:
      quant = q.QuantConfig.from_config(raw)
    except q.QuantError as e:
      raise CheckpointError(f"{path}/config.json: {e}") from None
    return cls(SafetensorsDir(path), quant)

  # --- construction helpers

  def _where(self, name: str) -> str:
    return f"{self.path}/{self.ckpt.file_of(name)}"

  def _add_fp8(self, weight: str, scale: str, names: set[str]) -> None:
    """Registers the fp8 weight ``weight`` with its scale ``scale``, checked exactly against the format that
    quantization_config declares (dtype of both, shape of the scale grid); nothing is inferred from shapes."""
    if weight not in names:
      raise CheckpointError(f"{self._where(scale)}: {scale!r} has no matching weight {weight!r}")
    if self.quant is None:
      raise CheckpointError(f"{self._where(scale)}: {weight!r} is quantized (with {scale!r}) but config.json has no "
                            "quantization_config declaring its format")
    fmt = self.quant.format
    if fmt not in q.SCALE_DTYPES:
      raise CheckpointError(f"{self._where(scale)}: {scale!r} is an fp8 block scale but quantization_config "
                            f"declares quant_method {self.quant.method!r} ({fmt})")
    w_dtype, s_dtype = self.ckpt.dtype(weight), self.ckpt.dtype(scale)
    if w_dtype != "F8_E4M3":
      raise CheckpointError(f"{self._where(weight)}: {weight!r} has dtype {w_dtype} but comes with {scale!r}; "
                            f"{fmt} weights are F8_E4M3 (float8_e4m3fn)")
    if s_dtype not in q.SCALE_DTYPES[fmt]:
      raise CheckpointError(f"{self._where(scale)}: {scale!r} has dtype {s_dtype}; {fmt} (quant_method "
                            f"{self.quant.method!r}) stores its scales as {' or '.join(q.SCALE_DTYPES[fmt])}")
    w_shape, s_shape = self.ckpt.shape(weight), self.ckpt.shape(scale)
    block = self.quant.block
    if len(w_shape) < 2:
      raise CheckpointError(f"{self._where(weight)}: fp8 weight {weight!r} has shape {list(w_shape)}; expected "
                            "[..., out, in]")
    want = q.scale_grid(w_shape, block)
    if tuple(s_shape) != want:
      raise CheckpointError(f"{self._where(scale)}: {scale!r} has shape {list(s_shape)} but {fmt} (quant_method "
                            f"{self.quant.method!r}, blocks of {block[0]}x{block[1]}) implies {list(want)} for "
                            f"{weight!r} of shape {list(w_shape)}")
    self._format[weight] = fmt
    self._blocks[weight] = block
    self._parts[weight] = (weight, scale)
    self._shape[weight] = w_shape
    self._dtype[weight] = "F32"

  def _add_nvfp4(self, base: str, names: set[str]) -> None:
    packed, scale, gscale = base + q.PACKED, base + q.SCALE, base + q.GLOBAL_SCALE
    if self.quant is not None and self.quant.format != "nvfp4":
      raise CheckpointError(f"{self._where(packed)}: {packed!r} is NVFP4 but quantization_config declares "
                            f"quant_method {self.quant.method!r} ({self.quant.format})")
    for need in (scale, gscale):
      if need not in names:
        raise CheckpointError(f"{self._where(packed)}: NVFP4 weight {packed!r} has no {need!r}")
    p_shape, s_shape = self.ckpt.shape(packed), self.ckpt.shape(scale)
    if self.ckpt.dtype(packed) != "U8" or self.ckpt.dtype(scale) != "F8_E4M3":
      raise CheckpointError(f"{self._where(packed)}: NVFP4 {packed!r} must be U8 with an F8_E4M3 {scale!r}; got "
                            f"{self.ckpt.dtype(packed)} and {self.ckpt.dtype(scale)}")
    cols = p_shape[-1] * 2
    if len(p_shape) < 2 or s_shape[:-1] != p_shape[:-1] or s_shape[-1] * q.NVFP4_GROUP != cols:
      raise CheckpointError(f"{self._where(scale)}: NVFP4 scale {scale!r} shape {list(s_shape)} does not match "
                            f"packed weight shape {list(p_shape)} (one scale per {q.NVFP4_GROUP} elements)")
    if self.ckpt.dtype(gscale) != "F32":
      raise CheckpointError(f"{self._where(gscale)}: NVFP4 global scale {gscale!r} must be F32, got "
                            f"{self.ckpt.dtype(gscale)}")
    weight = base + ".weight"
    if weight in names:
      raise CheckpointError(f"{self._where(weight)}: {weight!r} and {packed!r} both present")
    self._format[weight] = "nvfp4"
    self._blocks[weight] = (1, q.NVFP4_GROUP)
    self._parts[weight] = (packed, scale, gscale)
    self._shape[weight] = tuple(p_shape[:-1]) + (cols,)
    self._dtype[weight] = "F32"

  # --- read interface (SafetensorsDir-compatible, logical names)

  def keys(self) -> list[str]:
    return list(self._parts)

  def __iter__(self) -> Iterator[str]:
    return iter(self._parts)

  def __contains__(self, name: str) -> bool:
    return name in self._parts

  def shape(self, name: str) -> tuple[int, ...]:
    return self._shape[name]

  def dtype(self, name: str) -> str:
    """The safetensors dtype of a plain tensor; 'F32' for a dequantized one (see ``quant_format``)."""
    return self._dtype[name]

  def file_of(self, name: str) -> str:
    return self.ckpt.file_of(self._parts[name][0])

  def quant_format(self, name: str) -> q.Format | None:
    return self._format.get(name)

  def physical(self, name: str) -> tuple[str, ...]:
    """The stored tensors behind logical ``name``."""
    return self._parts[name]

  def nbytes(self, name: str) -> int:
    """Bytes stored on disk for logical ``name`` (all its parts)."""
    return sum(_nbytes(self.ckpt.shape(p), self.ckpt.dtype(p)) for p in self._parts[name])

  def get(self, name: str, rows: slice | None = None) -> np.ndarray:
    """Reads (and dequantizes to fp32) logical tensor ``name``; ``rows`` slices its leading axis."""
    if name not in self._parts:
      raise CheckpointError(f"{self.path}: no tensor {name!r}")
    fmt = self._format.get(name)
    if fmt is None:
      return self._read(name, rows)
    try:
      if fmt == "nvfp4":
        return q.dequantize_nvfp4(*[self._read(p, rows) for p in self._parts[name]])
      values, scales = self.get_values(name, rows), self.get_scales(name, rows)
      block = self._blocks[name]
      if rows is not None and values.ndim == 2:  # rows of a matrix: its scale rows, one per weight row
        out = self._shape[name][0]
        scales = np.repeat(scales, block[0], axis=0)[:out][rows]
        block = (1, block[1])
      return q.dequantize_blocked(values, scales, block)
    except (ValueError, q.QuantError) as e:
      raise CheckpointError(f"{self._where(name)}: cannot dequantize {name!r} ({fmt}): {e}") from None

  # --- fp8 weights as stored (mxfp8 / fp8_block): values and scales, for weights kept quantized

  def block(self, name: str) -> tuple[int, int]:
    """(rows, cols) of one scale of the fp8 weight ``name`` (the block quantization_config declares)."""
    return self._blocks[name]

  def scale_dtype(self, name: str) -> np.dtype:
    """uint8 (E8M0) or float32: how the scales of the fp8 weight ``name`` are stored (float8_e4m3fn: nvfp4's)."""
    stored = self.ckpt.dtype(self._parts[name][1])
    if stored == "F8_E4M3":
      return np.dtype(ml_dtypes.float8_e4m3fn)
    return np.dtype(np.uint8) if stored in q.E8M0_DTYPES else np.dtype(np.float32)

  def get_values(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The values of quantized weight ``name`` as stored: float8_e4m3fn [..., out, in] (fp8) or uint8
    [..., out, in / 2] (nvfp4, packed); ``rows`` slices the leading axis."""
    return self._read(self._parts[name][0], rows)

  def global_scale_size(self, name: str) -> int:
    """Elements of the nvfp4 weight ``name``'s stored global scale (1: one per tensor)."""
    return int(np.prod(self.ckpt.shape(self._parts[name][2]), dtype=np.int64))

  def get_global_scale(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The nvfp4 weight ``name``'s global scale as an fp32 multiplier [1] (the stored divisor inverted in fp32,
    ``quantized.nvfp4_multiplier``); ``rows`` is accepted for the reader interface and must leave one value
    (a per-tensor scale). CheckpointError for a scale that is not one positive finite value."""
    part = self._parts[name][2]
    g = self._read(part, None).astype(np.float32).reshape(-1)
    if g.size != 1 or not (np.isfinite(g[0]) and g[0] > 0):
      raise CheckpointError(f"{self._where(part)}: NVFP4 global scale {part!r} must be one positive finite value "
                            f"to keep {name!r} packed, got shape {list(self.ckpt.shape(part))} "
                            f"{g[:4].tolist()}")
    return q.nvfp4_multiplier(g)

  def get_scales(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The scales of fp8 weight ``name`` as stored (uint8 E8M0 or float32); ``rows`` slices the leading axis of
    a stacked [E, out, in] weight (experts); a matrix's scales are read whole."""
    arr = self._read(self._parts[name][1], rows if len(self._shape[name]) > 2 else None)
    return arr.astype(self.scale_dtype(name), copy=False)

  def _read(self, name: str, rows: slice | None) -> np.ndarray:
    return read_tensor(os.path.join(self.path, self.ckpt.file_of(name)), name, rows)

  # --- checks

  def check(self, names: Iterable[str]) -> None:
    """Raises CheckpointError unless each logical tensor has a float dtype and is quantized exactly when the
    config's quantization_config says it should be."""
    for name in names:
      fmt, dtype, shape = self._format.get(name), self._dtype[name], self._shape[name]
      if fmt is None and dtype not in FLOAT_DTYPES:
        hint = " (a quantized weight without its scale tensor?)" if dtype.startswith("F8") else ""
        raise CheckpointError(f"{self._where(name)}: tensor {name!r} has dtype {dtype}, expected a float dtype "
                              f"({', '.join(FLOAT_DTYPES)}){hint}")
      linear = q.is_linear_weight(name, len(shape))
      module = name[: -len(".weight")]
      if fmt is not None and self.quant is None:
        raise CheckpointError(f"{self._where(name)}: {name!r} is quantized ({fmt}, tensors "
                              f"{list(self._parts[name])}) but config.json has no quantization_config")
      if self.quant is None or not linear:
        if fmt is not None and not linear:
          raise CheckpointError(f"{self._where(name)}: {name!r} is quantized ({fmt}) but is not a Linear weight")
        continue
      expected = self.quant.expects_quantized(module)
      if fmt is not None and not expected:
        raise CheckpointError(f"{self._where(name)}: {name!r} is quantized ({fmt}) but quantization_config lists "
                              f"{module!r} as not converted (ignored_layers / modules_to_not_convert / ignore)")
      if fmt is None and expected:
        raise CheckpointError(f"{self._where(name)}: {name!r} is stored unquantized ({dtype}) but "
                              f"quantization_config (quant_method {self.quant.method!r}) quantizes {module!r}; "
                              "add it to ignored_layers or provide its scales")


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
  return int(np.prod(shape, dtype=np.int64)) * NUMPY_DTYPES[dtype].itemsize
