"""Byte-level safetensors I/O: tensor reads (whole or a leading-axis row range) straight from the file, any dtype
(bf16 / fp8 via ml_dtypes, E8M0 as raw uint8), and a streaming writer that never holds more than one tensor.

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {...}} padded with spaces to a multiple of 8, then the data (offsets relative to its start).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from m3jax.checkpoint.errors import CheckpointError

NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(np.uint8),
}
SAFETENSORS_DTYPES: dict[np.dtype, str] = {v: k for k, v in NUMPY_DTYPES.items() if k != "F8_E8M0"}


def read_header(path: str) -> tuple[int, dict]:
  """(data start offset, header dict) of a safetensors file; CheckpointError if unreadable."""
  try:
    st = os.stat(path)
  except OSError as e:
    raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
  return _read_header(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _read_header(path: str, mtime_ns: int, size: int) -> tuple[int, dict]:
  del mtime_ns, size  # cache keys only
  try:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      if n > 100 * 2**20:
        raise ValueError(f"header length {n} is implausible")
      header = json.loads(f.read(n))
  except (OSError, ValueError, struct.error, RecursionError) as e:
    raise CheckpointError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: unreadable safetensors header (a JSON {type(header).__name__}, not an object)")
  return 8 + n, header


def _entry(path: str, header: dict, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
  """A tensor's header entry, checked -> (numpy dtype, shape, begin, end); CheckpointError naming what is wrong."""
  entry = header.get(name)
  if entry is None or name == "__metadata__":
    raise CheckpointError(f"{path}: no tensor {name!r}")
  if not isinstance(entry, dict):
    raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {entry!r:.60}")
  st_dtype = entry.get("dtype")
  dtype = NUMPY_DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
  if dtype is None:
    raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {st_dtype!r:.40}")
  shape, offsets = entry.get("shape"), entry.get("data_offsets")
  if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                            for n in shape):
    raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r:.60}")
  if (not isinstance(offsets, list) or len(offsets) != 2
      or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in offsets)
      or offsets[0] > offsets[1]):
    raise CheckpointError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r:.60}")
  return dtype, tuple(shape), offsets[0], offsets[1]


def read_tensor(path: str, name: str, rows: slice | None = None) -> np.ndarray:
  """Reads tensor ``name`` from safetensors file ``path``; ``rows`` (step 1) selects a leading-axis range.

  Raises CheckpointError naming the file and tensor for a missing tensor, an unknown dtype or a truncated file.
  """
  start, header = read_header(path)
  dtype, shape, begin, end = _entry(path, header, name)
  st_dtype = header[name]["dtype"]
  if rows is not None:
    if not shape:
      raise CheckpointError(f"{path}: cannot take rows of scalar tensor {name!r}")
    lo, hi, step = rows.indices(shape[0])
    if step != 1:
      raise ValueError("row slices must have step 1")
    row_bytes = (end - begin) // shape[0] if shape[0] else 0
    begin, end = begin + lo * row_bytes, begin + hi * row_bytes
    shape = (max(hi - lo, 0),) + shape[1:]
  count = math.prod(shape)  # Python ints: a damaged header's huge shape must not wrap around
  if (end - begin) != count * dtype.itemsize:
    raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} data bytes for shape {list(shape)} "
                          f"{st_dtype}")
  size = os.path.getsize(path)
  if start + end > size:
    raise CheckpointError(f"{path}: file is truncated ({size} bytes) inside tensor {name!r} "
                          f"(needs {start + end} bytes)")
  with open(path, "rb") as f:
    arr = np.fromfile(f, dtype=dtype, count=count, offset=start + begin)
  return arr.reshape(shape)


class StreamingWriter:
  """Writes one safetensors file whose tensor list is known up front; data arrive in that order, possibly as
  several leading-axis pieces per tensor (``write(name, piece)``). ``close`` checks every byte was written.

  Args:
    path: output file.
    entries: (name, shape, safetensors dtype) in file order.
    metadata: the ``__metadata__`` strings (e.g. {"format": "pt"}).
  """

  def __init__(self, path: str, entries: Sequence[tuple[str, tuple[int, ...], str]],
               metadata: dict[str, str] | None = None):
    self.path = path
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    self._order: list[tuple[str, int]] = []
    for name, shape, dtype in entries:
      nbytes = int(np.prod(shape, dtype=np.int64)) * NUMPY_DTYPES[dtype].itemsize
      header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
      self._order.append((name, nbytes))
      offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    self._dtypes = {name: header[name]["dtype"] for name, _ in self._order}
    self._file = open(path, "wb")
    self._file.write(struct.pack("<Q", len(raw)) + raw)
    self._index, self._written = 0, 0
    self._skip_empty()

  def _skip_empty(self) -> None:
    while self._index < len(self._order) and self._order[self._index][1] == 0:
      self._index += 1

  def write(self, name: str, array: np.ndarray) -> None:
    """Appends ``array`` (all or the next leading-axis rows of tensor ``name``)."""
    if self._index >= len(self._order) or self._order[self._index][0] != name:
      expected = self._order[self._index][0] if self._index < len(self._order) else "nothing"
      raise ValueError(f"{self.path}: got data for {name!r}, expected {expected!r}")
    want = self._dtypes[name]
    if SAFETENSORS_DTYPES.get(array.dtype) != want:
      raise ValueError(f"{self.path}: tensor {name!r} is {want}, got numpy {array.dtype}")
    data = np.ascontiguousarray(array)
    self._file.write(memoryview(data.reshape(-1).view(np.uint8)))
    self._written += data.nbytes
    total = self._order[self._index][1]
    if self._written > total:
      raise ValueError(f"{self.path}: more data than the {total} bytes of {name!r}")
    if self._written == total:
      self._index, self._written = self._index + 1, 0
      self._skip_empty()

  def close(self) -> None:
    self._file.close()
    if self._index != len(self._order):
      raise ValueError(f"{self.path}: closed before tensor {self._order[self._index][0]!r} was written")

  def __enter__(self) -> "StreamingWriter":
    return self

  def __exit__(self, *exc) -> None:
    if exc[0] is None:
      self.close()
    else:
      self._file.close()
