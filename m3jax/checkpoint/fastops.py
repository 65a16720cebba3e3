"""Layout ops on the ml_dtypes types (bfloat16, float8_*) through integer views: numpy concatenates / stacks
them through generic dtype hooks, ~4x slower than the same bytes as uint16 / uint8.

``apply_layout`` runs a pure layout function (transpose / reshape / concatenate / stack, i.e. a TensorRule's
to_param or from_param) on same-width unsigned-integer views and views the results back: bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_CARRIERS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


def _is_ml_dtype(dtype: np.dtype) -> bool:
  return dtype.type.__module__ == "ml_dtypes"


def apply_layout(fn: Callable[[Sequence[np.ndarray]], Any], arrays: Sequence[np.ndarray]) -> Any:
  """``fn(arrays)`` computed on integer views when all arrays share one ml_dtypes dtype (else directly).

  ``fn`` must only move elements (a TensorRule transform); it returns an array or a list of arrays.
  """
  dtypes = {a.dtype for a in arrays}
  if len(dtypes) != 1:
    return fn(arrays)
  dtype = dtypes.pop()
  carrier = _CARRIERS.get(dtype.itemsize)
  if carrier is None or not _is_ml_dtype(dtype):
    return fn(arrays)
  out = fn([a.view(carrier) for a in arrays])
  if isinstance(out, np.ndarray):
    return out.view(dtype) if out.dtype == carrier else out
  return [o.view(dtype) if o.dtype == carrier else o for o in out]


def transpose_last2(x: np.ndarray, block: int = 16, out: np.ndarray | None = None) -> np.ndarray:
  """``np.ascontiguousarray(np.swapaxes(x, -1, -2))``, ~4x faster for large matrices: copies ``block`` source
  rows at a time, so the strided side of each copy stays in cache (identical result). With ``out`` (shape
  [..., cols, rows], e.g. a column range of a bigger array) the result is written there."""
  x = np.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"transpose_last2 needs at least 2 dims, got shape {x.shape}")
  rows, cols = x.shape[-2:]
  if out is None:
    out = np.empty(x.shape[:-2] + (cols, rows), x.dtype)
  elif out.shape != x.shape[:-2] + (cols, rows):
    raise ValueError(f"out has shape {out.shape}, expected {x.shape[:-2] + (cols, rows)}")
  carrier = _CARRIERS.get(x.dtype.itemsize)
  if carrier is not None and _is_ml_dtype(x.dtype) and out.dtype == x.dtype:
    transpose_last2(x.view(carrier), block, out.view(carrier))
    return out
  if rows * cols < 1 << 16 or x.ndim > 3:
    out[...] = np.swapaxes(x, -1, -2)
    return out
  src = x if x.ndim == 3 else x[None]
  dst = out if out.ndim == 3 else out[None]
  for k in range(src.shape[0]):
    for i in range(0, rows, block):
      dst[k, :, i:i + block] = src[k, i:i + block].T
  return out
