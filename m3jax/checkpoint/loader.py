"""Load an M3 checkpoint into an M3ForCausalLM.

Two sources:
  * a safetensors directory (original MiniMax or HF layout; bf16/fp32 or MXFP8 / FP8-block / NVFP4 quantized,
    dequantized on load unless ``keep_quantized``: then MXFP8 / FP8-block weights stay fp8, fp8_params.py). Pipeline: ``build_rules`` (one TensorRule per parameter) -> ``plan_text_load`` (match
    against the checkpoint) -> read sources (``TensorSource``) -> transform (``rule.to_param``) -> ``fill`` the
    abstract model state, each array placed with its target sharding.
  * a directory written by ``m3jax convert`` (Orbax; see converted.py), restored straight into sharded arrays.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.checkpoint import converted, fp8_params
from m3jax.checkpoint import sharding as sharding_lib
from m3jax.checkpoint.fastops import apply_layout
from m3jax.checkpoint.fit import check_weights_fit
from m3jax.checkpoint.mapping import Layout, TensorRule, detect_layout, is_skipped, mtp_rules, prefixes, text_rules
from m3jax.checkpoint.quantized import QUANT_SUFFIXES
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.checkpoint.source import TensorSource
from m3jax.checkpoint.vision_mapping import vision_rules
from m3jax.config import M3Config
from m3jax.layers.quantized import QuantSpec
from m3jax.model import SUPPORTED_DTYPES, M3ForCausalLM, model_dtype
from m3jax.sharding import RULES, Rules, ShardingPlan, check_config, param_spec

_DTYPES = {"BF16": jnp.bfloat16, "F32": jnp.float32, "F16": jnp.float16}
ParamPath = tuple[Any, ...]
Checkpoint = SafetensorsDir | TensorSource


def build_rules(cfg: M3Config, layout: Layout, with_mtp: bool = False) -> list[TensorRule]:
  """Every model parameter's TensorRule for a ``layout`` checkpoint (the one place to add rules, e.g. vision).

  The vision tower + projector are included when ``cfg`` has a vision config (``text_only`` loads drop it), the
  MTP modules when ``with_mtp`` (original layout only: HF drops them on load, so HF layouts have none).
  """
  rules = text_rules(cfg.text, layout)
  if with_mtp:
    if layout != "original":
      raise CheckpointError(f"MTP modules exist only in the original layout: a {layout!r}-layout checkpoint carries "
                            "none (HF transformers drops them); use the original MiniMax checkpoint or one converted "
                            "from it")
    rules += mtp_rules(cfg.text)
  if cfg.vision is not None:
    try:
      rules += vision_rules(cfg, layout)
    except ValueError as e:
      raise CheckpointError(str(e)) from None
  return rules


def plan_text_load(cfg: M3Config, ckpt: Checkpoint, layout: Layout | None = None, with_mtp: bool = False,
                   skip_vision: bool = False) -> tuple[Layout, list[TensorRule]]:
  """Matches the checkpoint's tensors against the config; raises CheckpointError naming the first problem.

  Checks: every expected tensor present with the expected shape (and, for a TensorSource, a float dtype and the
  quantization its config announces), and no tensor left unexplained (``mtp.*`` tensors are skipped, not errors,
  unless ``with_mtp`` asks for the MTP modules; vision tower / projector tensors only with ``skip_vision``, a
  text-only load of a checkpoint whose config has a vision_config). ``layout`` overrides auto-detection.
  """
  if layout is None:
    try:
      layout = detect_layout(ckpt.keys())
    except ValueError as e:
      raise CheckpointError(f"{ckpt.path}: {e}") from None
  rules = build_rules(cfg, layout, with_mtp)
  used: set[str] = set()
  for rule in rules:
    for name, shape in zip(rule.sources, rule.source_shapes):
      if name not in ckpt:
        hint = {"vision": "; load with text_only=True to skip the vision tower",
                "mtp": "; load without with_mtp to skip the MTP modules"}.get(rule.path[0], "")
        raise CheckpointError(f"{ckpt.path}: missing tensor {name!r} (expected shape {list(shape)}) for "
                              f"parameter {'/'.join(map(str, rule.path))}{hint}")
      if ckpt.shape(name) != shape:
        raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: tensor {name!r} has shape "
                              f"{list(ckpt.shape(name))}, expected {list(shape)} from config.json")
      used.add(name)
  if isinstance(ckpt, TensorSource):
    ckpt.check(sorted(used))
  for name in ckpt.keys():
    if name in used or is_unused(cfg, name, layout, skip_vision):
      continue
    if name.endswith(QUANT_SUFFIXES):
      raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: {name!r} is a quantization scale but config.json "
                            "has no quantization_config")
    raise CheckpointError(f"{ckpt.path}/{ckpt.file_of(name)}: unexpected tensor {name!r} "
                          f"(shape {list(ckpt.shape(name))}) that this config does not use")
  return layout, rules


def is_unused(cfg: M3Config, name: str, layout: Layout, skip_vision: bool = False) -> bool:
  """Tensors the model does not load: ``mtp.*``, a tied LM head, and with ``skip_vision`` the vision tower /
  projector (otherwise one the vision rules did not use is unexpected)."""
  if cfg.text.tie_word_embeddings and name == prefixes(layout)[1]:
    return True
  return is_skipped(name, layout) and (skip_vision or name.startswith("mtp.") or ".mtp." in name)


def checkpoint_dtype(ckpt: Checkpoint, layout: Layout) -> jnp.dtype:
  """The dtype of the embedding table (bf16 or fp32 checkpoints)."""
  pre, _ = prefixes(layout)
  st = ckpt.dtype(pre + "embed_tokens.weight")
  if st not in _DTYPES:
    raise CheckpointError(f"{ckpt.path}: embedding dtype {st} is not a float dtype m3jax runs in")
  return jnp.dtype(_DTYPES[st])


def default_run_dtype(ckpt: Checkpoint, layout: Layout) -> jnp.dtype:
  """The dtype a model loaded without ``dtype=`` runs in: the checkpoint's own when m3jax runs in it (bf16,
  fp32); a float16 checkpoint raises CheckpointError asking for an explicit dtype (bf16 rounds its weights,
  fp32 keeps them exactly at twice the memory)."""
  own = checkpoint_dtype(ckpt, layout)
  if own.name not in SUPPORTED_DTYPES:
    raise CheckpointError(f"{ckpt.path}: the weights are {own.name}, which m3jax does not run in; pass dtype="
                          f"'bfloat16' or 'float32' (m3jax convert: --dtype) to cast them on loading")
  return own


def abstract_model(cfg: M3Config, dtype: jnp.dtype, kernels: str | None = None, with_mtp: bool = False,
                   quantized: dict[ParamPath, QuantSpec] | None = None
                   ) -> tuple[nnx.GraphDef, list[tuple[ParamPath, Any]]]:
  """(graphdef, [(param path, abstract variable)]) of an M3ForCausalLM; nothing is allocated. ``quantized``: the
  weights kept in fp8 (each a QuantizedLinear: paths .../values and .../scales)."""
  if with_mtp and cfg.text.num_mtp_modules < 1:
    raise CheckpointError("with_mtp: config.json has num_mtp_modules = 0, so there are no MTP modules to load")
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, kernels=kernels,
                                                   with_vision=cfg.vision is not None, with_mtp=with_mtp,
                                                   quantized=quantized))
  graphdef, state = nnx.split(abstract)
  return graphdef, list(nnx.to_flat_state(state))


def fill(graphdef: nnx.GraphDef, flat: Sequence[tuple[ParamPath, Any]],
         produce: Callable[[ParamPath, Any], jax.Array]) -> M3ForCausalLM:
  """Sets every variable of the abstract state to ``produce(path, var)`` (shape-checked) and merges the model."""
  for param_path, var in flat:
    value = produce(param_path, var)
    if tuple(value.shape) != tuple(var.shape):
      raise CheckpointError(f"internal: parameter {'/'.join(map(str, param_path))} built with shape "
                            f"{value.shape}, model expects {var.shape}")
    var.set_value(value)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def cast(value: np.ndarray, dtype: Any) -> np.ndarray:
  """numpy cast (round to nearest even via ml_dtypes for bf16), shared by load and convert so both agree bitwise."""
  dtype = np.dtype(dtype)
  return value if value.dtype == dtype else value.astype(dtype)


def place(value: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """Host array -> jax.Array on the default device, or laid out by ``sharding`` (each device gets its slice)."""
  if sharding is None:
    return jnp.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def load(path: str | os.PathLike, *, dtype: jnp.dtype | str | None = None, kernels: str | None = None,
         shardings: Any = None, mesh: jax.sharding.Mesh | None = None,
         axis_rules: sharding_lib.AxisRules | None = None, text_only: bool = False, with_mtp: bool = False,
         keep_quantized: bool | None = None) -> M3ForCausalLM:
  """Loads ``path`` into a ready-to-run model.

  Args:
    path: a safetensors checkpoint directory (original MiniMax or HF layout, possibly quantized) or a directory
      written by ``m3jax convert``.
    dtype: parameter/activation dtype; default: the checkpoint's own (bf16 stays bf16, fp32 stays fp32).
    kernels: 'reference' | 'pallas' | 'auto' (default $M3JAX_KERNELS or 'auto').
    shardings: target sharding per parameter: a Sharding, a callable (param_path, abstract_var) -> Sharding, or a
      pytree of Shardings keyed like the parameter state (see m3jax/checkpoint/sharding.py).
    mesh, axis_rules: alternatively, a mesh and logical-axis rules ((logical_name, mesh_axis), ...) applied to
      each parameter's logical axis names.
    text_only: skip the vision tower + projector even when config.json has a vision_config (by default they are
      loaded into ``model.vision`` whenever it has one).
    with_mtp: also load the MTP modules (``model.mtp``, the draft heads of m3jax.speculative) from an
      original-layout checkpoint or one converted from it (by default their tensors are skipped).
    keep_quantized: keep the linear weights a checkpoint stores in MXFP8 / FP8-block in that form (fp8 values +
      scales, ``m3jax.layers.quantized``; read as stored, never dequantized on the host) instead of dequantizing
      them to ``dtype``; NVFP4 (compressed-tensors) routed experts stay packed (uint8 values, e4m3 scales, fp32
      global multipliers), other NVFP4 tensors are dequantized. Default: False for a safetensors checkpoint, and
      for an ``m3jax convert`` output the form it was converted into (``--keep-quantized`` / ``--quantize``);
      False dequantizes those on restore.

  Returns:
    M3ForCausalLM with every text-backbone parameter filled (laid out as requested).
  """
  path = os.fspath(path)
  dtype = None if dtype is None else model_dtype(dtype)  # resolved before any file is read
  if os.path.isfile(path):
    raise CheckpointError(f"{path}: is a file; pass the checkpoint directory (the one holding config.json)")
  if converted.is_converted(path):
    return _load_converted(path, dtype, kernels, shardings, mesh, axis_rules, text_only, with_mtp, keep_quantized)
  if converted.looks_partial(path):
    raise CheckpointError(f"{path}: has an Orbax '{converted.STATE}' directory but no {converted.MARKER}: an "
                          "incomplete conversion; run `m3jax convert` again")
  cfg = M3Config.from_file(path)
  skip_vision = text_only and cfg.vision is not None
  if text_only:
    cfg = dataclasses.replace(cfg, vision=None)
  source = TensorSource.open(path)
  layout, rules = plan_text_load(cfg, source, with_mtp=with_mtp, skip_vision=skip_vision)
  dtype = default_run_dtype(source, layout) if dtype is None else dtype
  specs = fp8_params.kept_specs(rules, source, (*fp8_params.FP8_FORMATS, "nvfp4")) if keep_quantized else {}
  graphdef, flat = abstract_model(cfg, dtype, kernels, with_mtp, quantized=specs)
  placement = sharding_lib.placement_fn(sharding_lib.resolve(flat, shardings=shardings, mesh=mesh,
                                                             axis_rules=axis_rules))
  check_weights_fit(path, flat, placement)
  by_path = {rule.path: rule for rule in rules}
  unused = set(by_path)

  def produce(param_path: ParamPath, var: Any) -> jax.Array:
    if param_path[:-1] in specs and param_path[-1] in fp8_params.NVFP4_PARTS:  # kept quantized: read as stored
      rule = by_path[param_path[:-1]]
      unused.discard(rule.path)
      value = fp8_params.build(rule, param_path[-1], source, specs[rule.path])
      return place(value, placement(param_path))
    rule = by_path.get(param_path)
    if rule is None:
      raise CheckpointError(f"internal: no checkpoint rule for parameter {'/'.join(map(str, param_path))}")
    unused.discard(param_path)
    value = np.asarray(apply_layout(rule.to_param, [source.get(name) for name in rule.sources]))
    if value.shape != tuple(var.shape):
      raise CheckpointError(f"internal: parameter {'/'.join(map(str, param_path))} built with shape "
                            f"{value.shape}, model expects {var.shape}")
    return place(cast(value, var.dtype), placement(param_path))

  model = fill(graphdef, flat, produce)
  if unused:
    raise CheckpointError(f"internal: rules without parameters: {sorted(unused)[:3]}")
  return model


def load_on_mesh(path: str | os.PathLike, *, mesh: jax.sharding.Mesh, axis_rules: Rules | None = None,
                 **kwargs: Any) -> M3ForCausalLM:
  """``m3jax.load`` with a mesh: checks the mesh against config.json (m3jax.sharding.check_config), restores every
  parameter straight into its shard under ``axis_rules`` (default m3jax.sharding.RULES) and attaches the plan
  (``model.sharding_plan``), so that the model runs sharded. The mesh may lack some of ("data", "expert",
  "tensor"): a missing axis counts as size 1. ``kwargs`` are ``load``'s (dtype, kernels, text_only, with_mtp).
  """
  plan = ShardingPlan(mesh, RULES if axis_rules is None else tuple(axis_rules))
  check_config(M3Config.from_file(path), plan.mesh, plan.rules)
  # param_spec: fp8 scales keep replicated the dims a mesh axis does not divide (m3jax.sharding.fit_spec)
  model = load(path, shardings=lambda _, var: jax.sharding.NamedSharding(plan.mesh, param_spec(var, plan)),
               **kwargs)
  model.sharding_plan = plan
  return model


def _load_converted(path: str, dtype, kernels, shardings, mesh, axis_rules, text_only: bool = False,
                    with_mtp: bool = False, keep_quantized: bool | None = None) -> M3ForCausalLM:
  marker = converted.read_marker(path)
  cfg = M3Config.from_file(path)
  if text_only:
    cfg = dataclasses.replace(cfg, vision=None)
  dtype = jnp.dtype(marker["dtype"]) if dtype is None else dtype
  stored = converted.quantized_specs(marker)
  specs = stored if keep_quantized in (None, True) else {}
  graphdef, flat = abstract_model(cfg, dtype, kernels, with_mtp, quantized=specs)
  placement = sharding_lib.placement_fn(sharding_lib.resolve(flat, shardings=shardings, mesh=mesh,
                                                             axis_rules=axis_rules))
  check_weights_fit(path, flat, placement)
  model_flat = [(p, var) for p, var in flat if p[0] != "mtp"]
  ignore = ("vision",) if text_only else ()
  dequantize = {p: spec for p, spec in stored.items() if p not in specs}
  if dequantize:  # stored in fp8 but asked for dequantized: read values / scales on the host, dequantize, place
    _, stored_flat = abstract_model(cfg, dtype, kernels, False, quantized=stored)
    converted.check_params(path, [(p, v) for p, v in stored_flat if p[0] != "mtp"], ignore)
    model_flat = [(p, var) for p, var in model_flat if p not in dequantize]
  values = converted.restore_params(path, model_flat, placement, ignore=ignore,
                                    skip=tuple(dequantize) if dequantize else ())
  if dequantize:
    values.update(_dequantized_params(path, dequantize, flat, placement))
  if with_mtp:
    values.update(_converted_mtp_params(path, marker, cfg, [(p, var) for p, var in flat if p[0] == "mtp"],
                                        placement))
  return fill(graphdef, flat, lambda param_path, var: values.pop(param_path))


def _dequantized_params(path: str, specs: dict[ParamPath, QuantSpec], flat: Sequence[tuple[ParamPath, Any]],
                        placement: Callable[[ParamPath], Any]) -> dict[ParamPath, jax.Array]:
  """The parameters a converted checkpoint stores in fp8, dequantized on the host to the model's dtype."""
  from m3jax.checkpoint import orbax_io  # pylint: disable=g-import-not-at-top

  reader = orbax_io.SliceReader(converted.state_dir(path))
  out = {}
  for param_path, var in flat:
    if param_path not in specs:
      continue
    key = converted.model_key(param_path)
    value = fp8_params.dequantized_param(param_path, reader.read(key + ("values",)), reader.read(key + ("scales",)),
                                         specs[param_path], var.shape)
    out[param_path] = place(cast(value, var.dtype), placement(param_path))
  return out


def _converted_mtp_params(path: str, marker: dict[str, Any], cfg: M3Config, flat: Sequence[tuple[ParamPath, Any]],
                          placement: Callable[[ParamPath], Any]) -> dict[ParamPath, jax.Array]:
  """The MTP parameters from a converted checkpoint's raw 'mtp' subtree (tensors named relative to 'mtp.')."""
  stored = converted.extra_names(marker, converted.MTP)
  rules = {rule.path: rule for rule in mtp_rules(cfg.text, prefix="")}
  missing = [name for rule in rules.values() for name in rule.sources if name not in stored]
  if missing:
    raise CheckpointError(f"{path}: with_mtp, but the converted checkpoint has no MTP tensor {missing[0]!r} "
                          f"({len(missing)} missing; converted with --drop-mtp, or from a checkpoint without them?)")
  raw = converted.read_extras(path, converted.MTP)
  out = {}
  for param_path, var in flat:
    rule = rules[param_path]
    for name, shape in zip(rule.sources, rule.source_shapes):
      if raw[name].shape != shape:
        raise CheckpointError(f"{path}: MTP tensor {name!r} has shape {list(raw[name].shape)}, expected "
                              f"{list(shape)} from config.json")
    value = np.asarray(apply_layout(rule.to_param, [raw[name] for name in rule.sources]))
    out[param_path] = place(cast(value, var.dtype), placement(param_path))
  return out
