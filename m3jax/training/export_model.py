"""The trained model as a normal m3jax checkpoint: the directory ``m3jax convert`` writes (converted.py).

  DST/config.json, DST/m3jax_checkpoint.json (written last), DST/state/{model,mtp}/..., tokenizer files.
The trunk's parameters go under model/ keyed by their nnx paths; the MTP modules' under mtp/ by their original-
layout names relative to 'mtp.' (as convert keeps them), so ``m3jax.load(DST, with_mtp=True)``, ``generate``,
``serve``, ``convert``'s readers and ``export`` take it like any converted checkpoint. Written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.checkpoint import converted, fsutil, orbax_io
from m3jax.checkpoint.loader import abstract_model, cast
from m3jax.checkpoint.mapping import MTP_PREFIX, mtp_rules
from m3jax.config import M3Config
from m3jax.training.params import Params, key_of


def _whole(value: np.ndarray, dtype: np.dtype) -> orbax_io.LazyArray:
  arr = cast(np.asarray(value), dtype)
  return orbax_io.LazyArray(arr.shape, arr.dtype, [(tuple(slice(0, n) for n in arr.shape), lambda: arr)])


def export_trained(master: Params, config: M3Config, dst: str | os.PathLike, *, dtype: str = "bfloat16",
                   tokenizer_dir: str | os.PathLike | None = None, provenance: dict[str, Any] | None = None,
                   force: bool = False) -> str:
  """Writes the master weights (cast to ``dtype``; router weights and correction biases stay fp32, as the
  model keeps them) as an m3jax checkpoint at ``dst``; copies the tokenizer files of ``tokenizer_dir``."""
  dst = os.fspath(dst)
  cfg = dataclasses.replace(config, vision=None)
  with_mtp = any(k.startswith("mtp/") for k in master)
  _, flat = abstract_model(cfg, jnp.dtype(dtype), with_mtp=with_mtp)
  host = {k: np.asarray(jax.device_get(v)) for k, v in master.items()}
  leaves: dict[orbax_io.KeyPath, orbax_io.LazyArray] = {}
  targets = {key_of(path): np.dtype(var.dtype) for path, var in flat}
  if set(targets) != set(host):
    raise ValueError(f"trained parameters and config {dst} disagree: {sorted(set(targets) ^ set(host))[:3]}")
  for path, var in flat:
    if path[0] != "mtp":
      leaves[converted.model_key(path)] = _whole(host[key_of(path)], targets[key_of(path)])
  extras: dict[str, str] = {}
  if with_mtp:
    for rule in mtp_rules(cfg.text):
      key = key_of(rule.path)
      for name, arr in zip(rule.sources, rule.from_param(host[key])):
        rel = name[len(MTP_PREFIX):]
        extras[rel] = name
        leaves[converted.extra_key(converted.MTP, rel)] = _whole(arr, targets[key])
  with fsutil.atomic_output_dir(dst, force) as tmp:
    orbax_io.save_streaming(os.path.join(tmp, converted.STATE), orbax_io.nest(leaves))
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
    aux = []
    if tokenizer_dir is not None:
      for name in sorted(os.listdir(tokenizer_dir)):
        shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        aux.append(name)
    marker = {"format": converted.FORMAT, "version": converted.VERSION, "dtype": jnp.dtype(dtype).name,
              "source": {"trained_by": "m3jax train", **(provenance or {})},
              "extras": {converted.MTP: extras}, "skipped": {}, "aux_files": aux}
    with open(os.path.join(tmp, converted.MARKER), "w") as f:  # last: marks the directory complete
      json.dump(marker, f, indent=2)
  return dst


def model_bytes(master: Params, dtype: str = "bfloat16") -> int:
  """Bytes of the weights as ``export_trained`` stores them (router weights / biases fp32)."""
  itemsize = jnp.dtype(dtype).itemsize
  return sum(int(v.size) * (4 if k.endswith(("mlp/router", "mlp/correction_bias")) else itemsize)
             for k, v in master.items())
