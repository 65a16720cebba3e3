"""Orbax (orbax-checkpoint 0.12.4) I/O for converted checkpoints: streaming save, metadata, sharded restore, and
leading-axis slice reads.

Saving streams: each leaf is a ``LazyArray`` (shape, dtype and a list of row pieces with a producer each). A
registered TypeHandler writes the pieces one after another into the array's TensorStore (zarr3 in OCDBT, the
layout Orbax's own NumpyHandler writes and records as 'np.ndarray'), so host memory holds one piece (plus the one
being written) instead of the tree. The result is an ordinary Orbax PyTree checkpoint: plain
``ocp.PyTreeCheckpointer().restore(path)`` reads it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handler_registry as registry_lib
from orbax.checkpoint._src.serialization import type_handlers

KeyPath = tuple[str, ...]
# Zarr chunks of at most this many bytes: partial (sharded) restores read only the chunks they need.
CHUNK_BYTES = 64 * 2**20
# Data handed to TensorStore but not yet written while the next piece is built (see _LazyArrayHandler).
INFLIGHT_BYTES = 256 * 2**20


@dataclasses.dataclass
class LazyArray:
  """A leaf produced piece by piece: ``pieces`` = [(index, make)] whose regions (a slice per axis) tile the
  array; make() returns array[index] as a numpy array of ``dtype``. The first piece is the largest (it sets the
  chunk layout). ``on_piece(nbytes)`` is called after each piece is written (progress reporting)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  pieces: Sequence[tuple[tuple[slice, ...], Callable[[], np.ndarray]]]
  on_piece: Callable[[int], None] | None = None

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize


class _LazyArrayHandler(type_handlers.NumpyHandler):
  """Writes LazyArray leaves piece by piece (metadata identical to NumpyHandler's, so it restores as np.ndarray).

  Pieces are built in order; writes already handed to TensorStore overlap with building the next piece, with
  at most INFLIGHT_BYTES of data pending, so host memory holds the piece being built (and its sources) plus at
  most INFLIGHT_BYTES.
  """

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)
    pending: list[tuple[Any, int, Callable[[int], None] | None]] = []

    async def drain(limit: int) -> None:
      while pending and sum(n for _, n, _ in pending) > limit:
        future, nbytes, callback = pending.pop(0)
        await future
        if callback:
          callback(nbytes)

    async def open_store(value, info, arg):
      await info.await_path_creation()
      piece_shape = tuple(max(s.stop - s.start, 1) for s in value.pieces[0][0])
      chunks = chunk_shape(piece_shape, np.dtype(value.dtype).itemsize, CHUNK_BYTES)
      spec = ts_utils.build_array_write_spec(
          info=info, arg=arg, global_shape=value.shape, local_shape=chunks, dtype=np.dtype(value.dtype),
          use_ocdbt=info.is_ocdbt_checkpoint,
          process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
      return await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)

    # Creating an array writes its metadata; do all of them concurrently (sequentially it costs ~25 ms each).
    stores = await asyncio.gather(*[open_store(v, i, a) for v, i, a in zip(values, infos, args)])
    try:
      for value, info, store in zip(values, infos, stores):
        for index, make in value.pieces:
          data = np.asarray(make())
          want = tuple(s.stop - s.start for s in index)
          if data.shape != want or data.dtype != np.dtype(value.dtype):
            raise ValueError(f"internal: piece {index} of {info.name} is {data.shape} {data.dtype}, "
                             f"expected {want} {np.dtype(value.dtype)}")
          target = store[index] if value.shape else store
          # The arrays are never modified after this point, so TensorStore may keep references instead of copies.
          pending.append((target.write(data, can_reference_source_data_indefinitely=True), data.nbytes,
                          value.on_piece))
          del data
          await drain(INFLIGHT_BYTES)
    except BaseException:
      for future, _, _ in pending:  # let TensorStore finish touching the directory before the caller removes it
        try:
          await future
        except Exception:  # pylint: disable=broad-except
          pass
      raise
    await drain(-1)
    return []


def chunk_shape(piece_shape: tuple[int, ...], itemsize: int, max_bytes: int) -> tuple[int, ...]:
  """Zarr chunks = C-contiguous blocks of a piece: the leading axes are divided (by divisors of the piece shape,
  so chunks tile every piece) until a chunk holds at most ``max_bytes``. Writing a piece is then a plain copy of
  consecutive rows per chunk, and a sharded restore reads only the chunks of its slice."""
  shape = list(piece_shape)
  for axis in range(len(shape)):
    rest = int(np.prod(shape[axis + 1:], dtype=np.int64)) * itemsize
    if shape[axis] * rest <= max_bytes:
      break
    fits = [d for d in range(1, shape[axis] + 1) if shape[axis] % d == 0 and d * rest <= max_bytes]
    shape[axis] = max(fits) if fits else 1
    if fits:
      break
  return tuple(shape)


def _registry():
  return registry_lib.create_type_handler_registry(*registry_lib._DEFAULT_TYPE_HANDLERS,  # pylint: disable=protected-access
                                                   (LazyArray, _LazyArrayHandler()))


def save_streaming(path: str, tree: Mapping[str, Any]) -> None:
  """Saves a nested dict of LazyArray leaves (str keys) as an Orbax PyTree checkpoint at ``path`` (must not exist).

  Uncompressed zarr3 in OCDBT; chunks of at most CHUNK_BYTES within each piece (see chunk_shape).
  """
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_registry(), use_zarr3=True, use_compression=False)
  save_args = jax.tree.map(lambda leaf: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree,
                           is_leaf=lambda x: isinstance(x, LazyArray))
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave(tree, save_args=save_args))


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """Stored shape and dtype of one leaf."""

  shape: tuple[int, ...]
  dtype: np.dtype


def leaf_metadata(path: str) -> dict[KeyPath, LeafInfo]:
  """Key path -> stored shape/dtype for every array leaf of the Orbax checkpoint at ``path`` (no data read).

  Reads the key paths from Orbax's ``_METADATA`` and opens every array with TensorStore directly, all at once,
  waiting for each open before returning or raising. (Orbax's own ``metadata()`` leaves TensorStore callbacks
  pending on an asyncio loop it has already closed when a data file is missing, and logs instead of naming the
  array.) ValueError naming the file or the first array that cannot be read.
  """
  path = os.path.abspath(path)
  meta_file = os.path.join(path, "_METADATA")
  try:
    with open(meta_file) as f:
      meta = json.load(f)
    entries = list(meta["tree_metadata"].values())
    keys = [tuple(str(k["key"]) for k in e["key_metadata"]) for e in entries]
    kinds = [e["value_metadata"]["value_type"] for e in entries]
  except FileNotFoundError:
    raise ValueError(f"{meta_file}: missing (not an Orbax checkpoint, or an unfinished one)") from None
  except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{meta_file}: unreadable Orbax metadata ({type(e).__name__}: {e})") from None
  for key, kind in zip(keys, kinds):
    if kind not in _ARRAY_VALUE_TYPES:
      raise ValueError(f"{meta_file}: leaf {'.'.join(key)!r} is a {kind!r}, not an array")
  context, driver = _read_context(), _zarr_driver(meta)
  opening = [ts.open(_array_spec(path, driver, key), open=True, read=True, context=context) for key in keys]
  out: dict[KeyPath, LeafInfo] = {}
  failure: tuple[KeyPath, Exception] | None = None
  for key, future in zip(keys, opening):  # wait for every open, failed or not, before raising
    try:
      store = future.result()
    except Exception as e:  # pylint: disable=broad-except  (TensorStore raises ValueError / OSError / others)
      failure = failure or (key, e)
      continue
    out[key] = LeafInfo(tuple(int(n) for n in store.shape), np.dtype(store.dtype.numpy_dtype))
  if failure:
    key, e = failure
    raise ValueError(f"{path}: cannot read array {'.'.join(key)!r} (missing or corrupt data files? "
                     f"{type(e).__name__}: {e})")
  return out


# Orbax value types of array leaves (what NumpyHandler / ArrayHandler record).
_ARRAY_VALUE_TYPES = ("np.ndarray", "jax.Array")


def _zarr_driver(meta: Mapping[str, Any]) -> str:
  """TensorStore driver of the arrays, from the checkpoint's parsed ``_METADATA``."""
  return "zarr3" if meta.get("use_zarr3") else "zarr"


def _read_context() -> ts.Context:
  """TensorStore context for reading a checkpoint's arrays (up to 32 concurrent file reads)."""
  return ts.Context({"file_io_concurrency": {"limit": 32}})


def _array_spec(path: str, driver: str, keypath: KeyPath) -> dict[str, Any]:
  """TensorStore spec of one array leaf of the OCDBT checkpoint at ``path``."""
  return {"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{path}", "path": ".".join(keypath)}}


def nest(flat: Mapping[KeyPath, Any]) -> dict[str, Any]:
  """{('a', 'b'): x} -> {'a': {'b': x}}; raises ValueError when a key is both a leaf and a subtree."""
  root: dict[str, Any] = {}
  for keypath, value in flat.items():
    node = root
    for k in keypath[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise ValueError(f"{'.'.join(keypath)}: {k!r} is both a tensor and a prefix of other tensors")
    if keypath[-1] in node:
      raise ValueError(f"{'.'.join(keypath)}: is both a tensor and a prefix of other tensors")
    node[keypath[-1]] = value
  return root


def restore(path: str, leaves: Mapping[KeyPath, tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding]]
            ) -> dict[KeyPath, jax.Array]:
  """Restores the given leaves (a subset of the checkpoint) straight into jax.Arrays with the given shardings,
  cast to the given dtypes. Each device reads only the chunks of its own shard. ValueError when a read
  fails."""
  item = nest({k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, (shape, dtype, sharding)
               in leaves.items()})
  restore_args = nest({k: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
                       for k, (shape, dtype, sharding) in leaves.items()})
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      out = ckptr.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    # Orbax wraps a TensorStore read error in a bare Exception carrying the whole TensorStore spec; its cause is
    # TensorStore's one-line error, which names the array (e.g. 'Error reading ... in "model.embed/c/0/0" ...').
    cause = e.__cause__ or e
    first_line = (str(cause).strip().splitlines() or [""])[0]
    raise ValueError(f"{path}: cannot restore (missing, truncated or corrupt data files? "
                     f"{type(cause).__name__}: {first_line})") from None
  result = {}
  for keypath in leaves:
    node = out
    for k in keypath:
      node = node[k]
    result[keypath] = node
  return result


class SliceReader:
  """Reads leaves (or leading-axis row ranges of them) of an Orbax checkpoint as numpy arrays via TensorStore."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    with open(os.path.join(self.path, "_METADATA")) as f:
      self._driver = _zarr_driver(json.load(f))
    self._stores: dict[KeyPath, Any] = {}
    self._ctx = _read_context()

  def _store(self, keypath: KeyPath):
    if keypath not in self._stores:
      self._stores[keypath] = ts.open(_array_spec(self.path, self._driver, keypath), open=True, read=True,
                                      context=self._ctx).result()
    return self._stores[keypath]

  def read(self, keypath: KeyPath, index: tuple[slice, ...] | slice | None = None) -> np.ndarray:
    """The whole leaf, or its region ``index`` (a slice per axis, or one slice of the leading axis)."""
    store = self._store(keypath)
    return np.asarray((store if index is None else store[index]).read().result())
