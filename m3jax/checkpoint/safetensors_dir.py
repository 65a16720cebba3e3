"""Read-only view of a safetensors checkpoint directory (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
from safetensors import safe_open

from m3jax.checkpoint.errors import CheckpointError
from m3jax.checkpoint.safetensors_stream import read_tensor

__all__ = ["CheckpointError", "SafetensorsDir", "read_weight_map"]

INDEX_NAME = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_weight_map(index_path: str) -> dict[str, str]:
  """An index file's weight_map (tensor name -> file name in the same directory), checked: CheckpointError naming
  the index for malformed JSON, a missing or malformed weight_map, or a file name that leaves the directory."""
  try:
    with open(index_path, "rb") as f:
      index = json.loads(f.read())
  except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
    raise CheckpointError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
  if not isinstance(index, dict):
    raise CheckpointError(f"{index_path}: the index must be a JSON object, got a JSON {type(index).__name__}")
  weight_map = index.get("weight_map")
  if not isinstance(weight_map, dict):
    raise CheckpointError(f"{index_path}: no 'weight_map' object")
  for name, fname in weight_map.items():
    if (not isinstance(fname, str) or not fname or fname in (".", "..") or "/" in fname or "\\" in fname
        or "\0" in fname):
      raise CheckpointError(f"{index_path}: tensor {name!r} maps to {fname!r:.60}, not a file name in the "
                            "checkpoint directory")
  return weight_map


class SafetensorsDir:
  """Tensor name -> (file, shape, dtype) for every tensor of a checkpoint directory; lazy reads.

  Pickle-based weights (``.bin``/``.pt``) are refused: loading them can execute arbitrary code.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if not os.path.isdir(self.path):
      raise CheckpointError(f"{self.path}: not a directory")
    files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
    if not files:
      pickles = [f for f in os.listdir(self.path) if f.endswith(_PICKLE_SUFFIXES)]
      if pickles:
        raise CheckpointError(
            f"{self.path}: only pickle-based weights ({', '.join(pickles[:3])}); these can execute code when "
            "loaded and are refused. Convert them to safetensors first (e.g. with HF save_pretrained).")
      raise CheckpointError(f"{self.path}: no .safetensors files")
    index_path = os.path.join(self.path, INDEX_NAME)
    self._file_of: dict[str, str] = {}
    if os.path.exists(index_path):
      weight_map = read_weight_map(index_path)
      for name, fname in weight_map.items():
        if not os.path.isfile(os.path.join(self.path, fname)):
          raise CheckpointError(f"{index_path}: tensor {name!r} points to missing file {fname!r}")
      files = sorted(set(weight_map.values()))
    self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
      full = os.path.join(self.path, fname)
      try:
        with safe_open(full, framework="numpy") as f:
          for name in f.keys():
            if name in self._file_of and self._file_of[name] != fname:
              raise CheckpointError(f"{self.path}: tensor {name!r} is in both {self._file_of[name]} and {fname}")
            sl = f.get_slice(name)
            self._file_of[name] = fname
            self._meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
      except CheckpointError:
        raise
      except Exception as e:  # safetensors raises its own error types for corrupt/truncated files
        raise CheckpointError(f"{full}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    if os.path.exists(index_path):
      missing = [n for n, fn in weight_map.items() if n not in self._meta]
      if missing:
        raise CheckpointError(f"{index_path}: tensor {missing[0]!r} is listed but absent from {weight_map[missing[0]]}")

  def keys(self) -> list[str]:
    return list(self._meta)

  def __contains__(self, name: str) -> bool:
    return name in self._meta

  def shape(self, name: str) -> tuple[int, ...]:
    return self._meta[name][0]

  def dtype(self, name: str) -> str:
    """The safetensors dtype string (e.g. 'BF16', 'F32', 'F8_E4M3', 'U8')."""
    return self._meta[name][1]

  def file_of(self, name: str) -> str:
    return self._file_of[name]

  def get(self, name: str) -> np.ndarray:
    """Reads one tensor as a numpy array (bf16/fp8 via ml_dtypes)."""
    if name not in self._meta:
      raise CheckpointError(f"{self.path}: no tensor {name!r}")
    full = os.path.join(self.path, self._file_of[name])
    return read_tensor(full, name)

  def __iter__(self) -> Iterator[str]:
    return iter(self._meta)
