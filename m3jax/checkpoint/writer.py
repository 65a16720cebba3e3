"""Write an m3jax model back as a safetensors checkpoint (original MiniMax layout by default)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from m3jax.checkpoint.fsutil import write_export_marker
from m3jax.checkpoint.loader import build_rules
from m3jax.checkpoint.mapping import Layout
from m3jax.checkpoint.safetensors_dir import INDEX_NAME
from m3jax.model import M3ForCausalLM


def model_tensors(model: M3ForCausalLM, layout: Layout = "original") -> dict[str, np.ndarray]:
  """Checkpoint tensor name -> numpy array for every parameter of ``model`` (text backbone, plus the vision
  tower + projector when ``model.vision`` is built, and the MTP modules when ``model.mtp`` is: original layout)."""
  params = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out: dict[str, np.ndarray] = {}
  cfg = model.config if getattr(model, "vision", None) is not None else dataclasses.replace(model.config, vision=None)
  rules = build_rules(cfg, layout, with_mtp=getattr(model, "mtp", None) is not None)
  for rule in rules:
    arrays = rule.from_param(params[rule.path])
    for name, arr, shape in zip(rule.sources, arrays, rule.source_shapes):
      assert arr.shape == shape, (name, arr.shape, shape)
      out[name] = arr
  return out


def write_checkpoint(model: M3ForCausalLM, out_dir: str | os.PathLike, *, layout: Layout = "original",
                     max_shard_bytes: int = 5 * 2**30) -> list[str]:
  """Writes config.json + safetensors shards (+ index when sharded) to ``out_dir``; returns the file names."""
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  tensors = model_tensors(model, layout)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in tensors.items():
    if shards[-1] and size + arr.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  files = []
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    files.append(fname)
    weight_map.update({name: fname for name in shard})
  if len(shards) > 1:
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    config = model.config
    if getattr(model, "vision", None) is None and config.vision is not None:
      config = dataclasses.replace(config, vision=None)  # no vision tensors written: no vision_config either
    json.dump(config.to_dict(), f, indent=2)
  write_export_marker(out_dir, writer="m3jax.checkpoint.writer.write_checkpoint")
  return files
