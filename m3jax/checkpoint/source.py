"""Logical tensors of a safetensors checkpoint: each quantized Linear appears as one dequantized ``X.weight``.

``TensorSource`` has the read interface of ``SafetensorsDir`` (keys / shape / dtype / file_of / get) over logical
names, plus row-range reads (stacked experts) and a check that the checkpoint's quantization matches its config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

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
    if weight not in names:
      raise CheckpointError(f"{self._where(scale)}: {scale!r} has no matching weight {weight!r}")
    if self.ckpt.dtype(weight) not in ("F8_E4M3", "F8_E5M2"):
      raise CheckpointError(f"{self._where(weight)}: {weight!r} has dtype {self.ckpt.dtype(weight)} but comes with "
                            f"{scale!r}; expected float8_e4m3fn")
    w_shape, s_shape = self.ckpt.shape(weight), self.ckpt.shape(scale)
    if len(w_shape) < 2 or len(s_shape) != len(w_shape) or w_shape[:-2] != s_shape[:-2]:
      raise CheckpointError(f"{self._where(scale)}: scale {scale!r} shape {list(s_shape)} does not fit weight "
                            f"shape {list(w_shape)}")
    stated = self.quant.weight_block_size if self.quant else None
    try:
      block = q.block_shape(w_shape, s_shape, stated)
    except q.QuantError as e:
      raise CheckpointError(f"{self._where(scale)}: {scale!r}: {e}") from None
    is_mx = block == (1, q.MX_BLOCK) and self.ckpt.dtype(scale) in ("U8", "F8_E8M0")
    self._format[weight] = "mxfp8" if is_mx else "fp8_block"
    self._blocks[weight] = block
    self._parts[weight] = (weight, scale)
    self._shape[weight] = w_shape
    self._dtype[weight] = "F32"

  def _add_nvfp4(self, base: str, names: set[str]) -> None:
    packed, scale, gscale = base + q.PACKED, base + q.SCALE, base + q.GLOBAL_SCALE
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
    weight = base + ".weight"
    if weight in names:
      raise CheckpointError(f"{self._where(weight)}: {weight!r} and {packed!r} both present")
    self._format[weight] = "nvfp4"
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
    arrays = [self._read(p, rows) for p in self._parts[name]]
    if fmt is None:
      return arrays[0]
    try:
      if fmt == "nvfp4":
        return q.dequantize_nvfp4(*arrays)
      return q.dequantize_blocked(arrays[0], arrays[1], self._blocks[name])
    except (ValueError, q.QuantError) as e:
      raise CheckpointError(f"{self._where(name)}: cannot dequantize {name!r} ({fmt}): {e}") from None

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
