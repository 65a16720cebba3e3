"""Load an M3 checkpoint directory (safetensors, original MiniMax or HF layout) into an M3ForCausalLM."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.checkpoint.mapping import Layout, TensorRule, detect_layout, is_skipped, prefixes, text_rules
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.config import M3Config
from m3jax.model import M3ForCausalLM

_DTYPES = {"BF16": jnp.bfloat16, "F32": jnp.float32, "F16": jnp.float16}


def plan_text_load(cfg: M3Config, ckpt: SafetensorsDir) -> tuple[Layout, list[TensorRule]]:
  """Matches the checkpoint's tensors against the config; raises CheckpointError naming the first problem.

  Checks: every expected tensor present with the expected shape, and no tensor left unexplained
  (vision and ``mtp.*`` tensors are skipped, not errors).
  """
  try:
    layout = detect_layout(ckpt.keys())
  except ValueError as e:
    raise CheckpointError(f"{ckpt.path}: {e}") from None
  rules = text_rules(cfg.text, layout)
  used: set[str] = set()
  for rule in rules:
    for name, shape in zip(rule.sources, rule.source_shapes):
      if name not in ckpt:
        raise CheckpointError(f"{ckpt.path}: missing tensor {name!r} (expected shape {list(shape)}) for "
                              f"parameter {'/'.join(map(str, rule.path))}")
      if ckpt.shape(name) != shape:
        raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: tensor {name!r} has shape "
                              f"{list(ckpt.shape(name))}, expected {list(shape)} from config.json")
      used.add(name)
  _, head_name = prefixes(layout)
  for name in ckpt.keys():
    if name in used or is_skipped(name, layout) or (cfg.text.tie_word_embeddings and name == head_name):
      continue
    if name.endswith(("weight_scale_inv", "weight_scale", "weight_packed", "weight_global_scale")):
      raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: {name!r} is a quantization scale; quantized "
                            "checkpoints are not supported by this loader")
    raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: unexpected tensor {name!r} "
                          f"(shape {list(ckpt.shape(name))}) that this config does not use")
  return layout, rules


def checkpoint_dtype(ckpt: SafetensorsDir, layout: Layout) -> jnp.dtype:
  """The dtype of the embedding table (bf16 or fp32 checkpoints)."""
  pre, _ = prefixes(layout)
  st = ckpt.dtype(pre + "embed_tokens.weight")
  if st not in _DTYPES:
    raise CheckpointError(f"{ckpt.path}: embedding dtype {st} is not a float dtype m3jax runs in")
  return jnp.dtype(_DTYPES[st])


def load(path: str | os.PathLike, *, dtype: jnp.dtype | str | None = None,
         kernels: str | None = None) -> M3ForCausalLM:
  """Loads ``path`` (config.json + safetensors) into a ready-to-run model.

  Args:
    path: checkpoint directory in the original MiniMax layout or an HF layout.
    dtype: parameter/activation dtype; default: the checkpoint's own (bf16 stays bf16, fp32 stays fp32).
    kernels: 'reference' | 'pallas' | 'auto' (default $M3JAX_KERNELS or 'auto').

  Returns:
    M3ForCausalLM with every text-backbone parameter filled.
  """
  path = os.fspath(path)
  cfg = M3Config.from_file(path)
  if cfg.text and _quantized(path):
    raise CheckpointError(f"{path}: config.json has a quantization_config; quantized checkpoints are not "
                          "supported by this loader")
  ckpt = SafetensorsDir(path)
  layout, rules = plan_text_load(cfg, ckpt)
  dtype = checkpoint_dtype(ckpt, layout) if dtype is None else jnp.dtype(dtype)
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=kernels))
  graphdef, state = nnx.split(abstract)
  by_path = {rule.path: rule for rule in rules}
  flat = nnx.to_flat_state(state)
  for param_path, var in flat:
    rule = by_path.pop(param_path, None)
    if rule is None:
      raise CheckpointError(f"internal: no checkpoint rule for parameter {'/'.join(map(str, param_path))}")
    value = rule.to_param([ckpt.get(name) for name in rule.sources])
    if value.shape != var.shape:
      raise CheckpointError(f"internal: parameter {'/'.join(map(str, param_path))} built with shape "
                            f"{value.shape}, model expects {var.shape}")
    var.set_value(jnp.asarray(np.asarray(value), dtype=var.dtype))
  if by_path:
    raise CheckpointError(f"internal: rules without parameters: {sorted(by_path)[:3]}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _quantized(path: str) -> bool:
  import json  # pylint: disable=g-import-not-at-top

  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  return bool(raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"))
