"""The safetensors and index readers on damaged files (#45): property tests (hypothesis) with random header bytes,
random JSON headers and random index files: every read either succeeds or raises CheckpointError naming the
file, never another exception. No model, no jax compilation."""

import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from m3jax.checkpoint.safetensors_dir import INDEX_NAME, CheckpointError, SafetensorsDir
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES, read_header, read_tensor

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(), st.text(max_size=6))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=10)
_SMALL = st.integers(-2, 40)
_ENTRY = st.one_of(_JSON, st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(NUMPY_DTYPES) + ["F4", "bf16"]), _SCALARS),
    "shape": st.one_of(st.lists(_SMALL, max_size=3), st.lists(st.integers(0, 2**40), max_size=3), _SCALARS),
    "data_offsets": st.one_of(st.lists(_SMALL, min_size=2, max_size=2), st.lists(_SMALL, max_size=3), _SCALARS)}))
_HEADERS = st.one_of(_JSON, st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), _ENTRY, max_size=3))


def _file_bytes(header: bytes, declared: int | None, data: bytes) -> bytes:
  return struct.pack("<Q", len(header) if declared is None else declared) + header + data


def _reads_or_checkpoint_error(path: str, names) -> None:
  try:
    read_header(path)
  except CheckpointError as e:
    assert path in str(e)
  for name in names:
    for rows in (None, slice(0, 1)):
      try:
        out = read_tensor(path, name, rows)
      except CheckpointError as e:
        assert path in str(e)
      else:
        assert isinstance(out, np.ndarray)


def _opens_or_checkpoint_error(directory: str) -> None:
  try:
    ckpt = SafetensorsDir(directory)
  except CheckpointError as e:
    assert directory in str(e) and "\n" not in str(e)
    return
  for name in ckpt.keys():  # what opens, reads
    assert isinstance(ckpt.get(name), np.ndarray)


@settings(max_examples=100, deadline=None)
@given(header=st.one_of(st.binary(max_size=48), _HEADERS.map(lambda h: json.dumps(h).encode())),
       declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)), data=st.binary(max_size=32))
@pytest.mark.quick
def test_random_header_bytes_read_or_raise_checkpoint_error(header, declared, data):
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "model.safetensors")
    with open(path, "wb") as f:
      f.write(_file_bytes(header, declared, data))
    try:
      names = list(json.loads(header)) if header[:1] == b"{" else ["a"]
    except ValueError:
      names = ["a"]
    _reads_or_checkpoint_error(path, names + ["missing"])
    _opens_or_checkpoint_error(d)


@settings(max_examples=100, deadline=None)
@given(index=st.one_of(_JSON, st.fixed_dictionaries({"weight_map": st.one_of(
    _JSON, st.dictionaries(st.sampled_from(["w", "v"]), st.one_of(
        st.sampled_from(["model.safetensors", "other.safetensors", "../model.safetensors", "", ".", "/etc/passwd"]),
        _SCALARS), max_size=2))})), raw=st.one_of(st.none(), st.binary(max_size=16)))
def test_random_index_files_open_or_raise_checkpoint_error(index, raw):
  with tempfile.TemporaryDirectory() as d:
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, INDEX_NAME), "wb") as f:
      f.write(json.dumps(index).encode() if raw is None else raw)
    _opens_or_checkpoint_error(d)


@pytest.mark.quick
def test_damaged_files_name_the_file_and_what_is_wrong(tmp_path):
  """Regressions for the shapes hypothesis found: headers and indexes that are JSON but not the expected objects."""
  path = str(tmp_path / "model.safetensors")
  cases = [(b"[1, 2]", "not an object"), (json.dumps({"a": 3}).encode(), "malformed header entry"),
           (json.dumps({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 0]}}).encode(),
            "0 data bytes for shape"),
           (json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}).encode(),
            "malformed data_offsets"),
           (json.dumps({"a": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}).encode(), "unsupported dtype"),
           (b"[" * 10_000 + b"]" * 10_000, "unreadable safetensors header")]
  for i, (header, message) in enumerate(cases):
    path = str(tmp_path / f"m{i}.safetensors")
    with open(path, "wb") as f:
      f.write(_file_bytes(header, None, b"\0" * 8))
    with pytest.raises(CheckpointError, match=message):
      read_tensor(path, "a")
  save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "model.safetensors"))
  for index, message in (([1], "the index must be a JSON object, got a JSON list"),
                         ({"weight_map": {"w": "../model.safetensors"}}, "not a file name in the checkpoint"),
                         ({"weight_map": {"w": 3}}, "maps to 3"), ({"weight_map": []}, "no 'weight_map' object")):
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
      SafetensorsDir(tmp_path)
  (tmp_path / INDEX_NAME).write_bytes(b"\xff{")
  with pytest.raises(CheckpointError, match="unreadable index"):
    SafetensorsDir(tmp_path)


@pytest.mark.quick
def test_directory_reads_bf16_and_fp8_tensors():
  """SafetensorsDir.get reads every dtype the checkpoints hold (it used safetensors' numpy backend, which cannot
  make bf16 / fp8 arrays: the MXFP8 fixture's tensors raised 'module numpy has no attribute float8_e4m3fn')."""
  d = SafetensorsDir(os.path.join(os.path.dirname(__file__), "fixtures", "mxfp8_b128", "checkpoint"))
  dtypes = {d.dtype(name) for name in d.keys()}
  assert {"F8_E4M3", "U8"} <= dtypes, dtypes
  for name in d.keys():
    got = d.get(name)
    assert got.shape == d.shape(name)
    np.testing.assert_array_equal(got.view(np.uint8), read_tensor(os.path.join(d.path, d.file_of(name)), name).view(np.uint8))
