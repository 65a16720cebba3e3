"""The directory ``m3jax convert`` writes, and reading it back.

  DST/config.json              normalised config (M3Config.to_dict())
  DST/m3jax_checkpoint.json    marker + provenance (written last; a directory without it is not a checkpoint);
                               its "quantized" entry lists the weights stored in fp8 (``convert --keep-quantized``
                               / ``--quantize``): {"quantization_config": ..., "params": {path: QuantSpec}}
  DST/state/                   one Orbax PyTree checkpoint with two subtrees:
      model/...                  the M3ForCausalLM parameters (vision tower included when config.json has a
                                 vision_config), keyed by their nnx paths (layers/3/mlp/w_gate_up; a weight kept
                                 in fp8 is two arrays, layers/3/mlp/w_gate_up/values and .../scales)
      mtp/...                    MTP tensors (``*.mtp.*``) under their checkpoint names relative to 'mtp.'
                                 (layers/0/enorm/weight), cast to the target dtype, router gates kept fp32
  DST/tokenizer.json, chat_template.*, ...   copied from the source
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from m3jax.checkpoint import orbax_io
from m3jax.checkpoint.safetensors_dir import CheckpointError

MARKER = "m3jax_checkpoint.json"
STATE = "state"
FORMAT = "m3jax-orbax"
VERSION = 1
MODEL, MTP = "model", "mtp"
EXTRA_TREES = (MTP,)
QUANTIZED = "quantized"  # marker entry of the weights stored in fp8

ParamPath = tuple[Any, ...]


def is_converted(path: str | os.PathLike) -> bool:
  """True for a directory written by ``m3jax convert`` (has the marker)."""
  return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def looks_partial(path: str | os.PathLike) -> bool:
  """An Orbax state directory without the marker: an interrupted or hand-copied conversion."""
  path = os.fspath(path)
  return os.path.isdir(os.path.join(path, STATE)) and not is_converted(path)


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
  path = os.fspath(path)
  try:
    with open(os.path.join(path, MARKER)) as f:
      marker = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}/{MARKER}: unreadable ({e})") from None
  if not isinstance(marker, dict):
    raise CheckpointError(f"{path}/{MARKER}: unreadable (a JSON {type(marker).__name__}, not an object)")
  if marker.get("format") != FORMAT or marker.get("version") != VERSION:
    raise CheckpointError(f"{path}/{MARKER}: format {marker.get('format')!r} version {marker.get('version')!r}; "
                          f"this m3jax reads {FORMAT!r} version {VERSION}")
  return marker


def model_key(path: ParamPath) -> orbax_io.KeyPath:
  """nnx parameter path -> key path in the state checkpoint."""
  return (MODEL,) + tuple(str(p) for p in path)


def extra_key(tree: str, rel_name: str) -> orbax_io.KeyPath:
  return (tree,) + tuple(rel_name.split("."))


def state_dir(path: str | os.PathLike) -> str:
  return os.path.join(os.fspath(path), STATE)


def quantized_specs(marker: dict[str, Any]) -> dict[ParamPath, Any]:
  """{parameter path: QuantSpec} of the weights a converted checkpoint stores in fp8 (empty: none)."""
  from m3jax.checkpoint.fp8_params import specs_from_json  # pylint: disable=g-import-not-at-top

  return specs_from_json((marker.get(QUANTIZED) or {}).get("params", {}))


def check_params(path: str, flat: Sequence[tuple[ParamPath, Any]], ignore: tuple[str, ...] = (),
                 allow: tuple[ParamPath, ...] = ()) -> dict[orbax_io.KeyPath, orbax_io.LeafInfo]:
  """Compares the stored model subtree with the model's parameters (from config.json); CheckpointError naming
  the first missing / unexpected parameter or shape mismatch. Stored parameters under a top-level module in
  ``ignore`` (e.g. 'vision' for a text-only load) or under a path of ``allow`` (fp8 weights read apart) are
  allowed."""
  try:
    meta = orbax_io.leaf_metadata(state_dir(path))
  except ValueError as e:  # names the file or the array
    raise CheckpointError(f"unreadable Orbax checkpoint: {e}") from None
  stored = {k: v for k, v in meta.items() if k[0] == MODEL}
  expected = {model_key(p): tuple(var.shape) for p, var in flat}
  for key, shape in expected.items():
    if key not in stored:
      raise CheckpointError(f"{state_dir(path)}: missing parameter {'/'.join(key[1:])!r} (expected shape "
                            f"{list(shape)} from config.json)")
    if stored[key].shape != shape:
      raise CheckpointError(f"{state_dir(path)}: parameter {'/'.join(key[1:])!r} has shape "
                            f"{list(stored[key].shape)}, expected {list(shape)} from config.json")
  allowed = {model_key(p) for p in allow}
  extra = sorted(k for k in set(stored) - set(expected)
                 if k[1] not in ignore and not any(k[:len(a)] == a for a in allowed))
  if extra:
    raise CheckpointError(f"{state_dir(path)}: unexpected parameter {'/'.join(extra[0][1:])!r} (shape "
                          f"{list(stored[extra[0]].shape)}) that this config does not use")
  return meta


def restore_params(path: str, flat: Sequence[tuple[ParamPath, Any]],
                   placement: Callable[[ParamPath], jax.sharding.Sharding | None], ignore: tuple[str, ...] = (),
                   skip: tuple[ParamPath, ...] = ()) -> dict[ParamPath, jax.Array]:
  """Reads every parameter straight into a jax.Array with its target sharding (default: the first local device)
  and the model's dtype for it (``ignore``: see check_params; ``skip``: stored parameters read elsewhere)."""
  check_params(path, flat, ignore, allow=skip)
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  leaves = {model_key(p): (tuple(var.shape), np.dtype(var.dtype), placement(p) or default) for p, var in flat}
  try:
    restored = orbax_io.restore(state_dir(path), leaves)
  except ValueError as e:  # names the directory and, where TensorStore says it, the array
    raise CheckpointError(str(e)) from None
  return {p: restored[model_key(p)] for p, _ in flat}


def extra_names(marker: dict[str, Any], tree: str) -> dict[str, str]:
  """Relative name -> source tensor name of the extra tensors kept in subtree ``tree`` ('mtp')."""
  return dict(marker.get("extras", {}).get(tree, {}))


def read_extras(path: str | os.PathLike, tree: str = MTP) -> dict[str, np.ndarray]:
  """The raw tensors of an extra subtree (e.g. MTP), keyed by name relative to the subtree (numpy)."""
  path = os.fspath(path)
  names = extra_names(read_marker(path), tree)
  reader = orbax_io.SliceReader(state_dir(path))
  return {rel: reader.read(extra_key(tree, rel)) for rel in names}
