"""Per-device memory plan: weight and cache bytes on each device for a mesh, batch and context length.

Pure arithmetic over the abstract model (nothing allocated, no devices needed), so the full 427B model can be
planned on a laptop: ``m3jax inspect PATH --mesh expert=8 --batch 8 --context 131072`` or ``plan_memory``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from m3jax import logical_axes as ax
from m3jax.sharding import RULES, Rules, check_config, fit_spec, format_mesh, logical_spec, mesh_sizes, spec_axes

# MXFP8 (M3_SPEC §6.1): one fp8 byte per weight plus one e8m0 scale byte per 32 weights.
FP8_BYTES = 1 + 1 / 32


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device (every device holds the same amount: shardings are even)."""

  mesh: dict[str, int]
  batch: int
  context: int
  weights: dict[str, int]  # component -> bytes per device
  weights_global: int  # bytes of one full copy of the weights
  cache: dict[str, int]  # 'kv' / 'index keys' -> bytes per device
  cache_global: int
  kv_heads_stored: int  # KV heads per layer in the cache (after replication)
  fused_projections: int = 0  # per device: every layer's projection weights concatenated (decode-loop workspace)
  split_experts: int = 0  # per device: fp32 expert weights' bf16 hi / lo split for the MoE kernels (same workspace)
  notes: tuple[str, ...] = ()

  @property
  def weights_per_device(self) -> int:
    return sum(self.weights.values())

  @property
  def cache_per_device(self) -> int:
    return sum(self.cache.values())

  @property
  def total_per_device(self) -> int:
    return self.weights_per_device + self.cache_per_device

  @property
  def decode_workspace(self) -> int:
    """Bytes per device of the weights a decode loop prepares once (``M3ForCausalLM.decode_weights``)."""
    return self.fused_projections + self.split_experts

  def check_fits(self, device_bytes: int | None, what: str = "this run") -> None:
    """Raise MemoryError, before anything is allocated, when weights + cache exceed one device's memory.

    Args:
      device_bytes: the memory one device can allocate (``m3jax.checkpoint.fit.device_limit``), or None where
        the backend does not say (CPU): nothing is checked then.
      what: names the run in the message.
    """
    if device_bytes is None or self.total_per_device <= device_bytes:
      return
    raise MemoryError(
        f"{what} needs {_gib(self.total_per_device).strip()} per device for weights + cache (weights "
        f"{_gib(self.weights_per_device).strip()}, cache {_gib(self.cache_per_device).strip()}) but a device has "
        f"{_gib(device_bytes).strip()}: use more devices (a larger mesh), a shorter context or a smaller batch")

  def lines(self) -> list[str]:
    n = math.prod(self.mesh.values())
    out = [f"per-device plan for mesh {format_mesh(self.mesh)} ({n} devices), batch {self.batch}, "
           f"context {self.context} tokens:"]
    for name, b in self.weights.items():
      out.append(f"  weights / {name:<15} {_gib(b):>10}")
    out.append(f"  weights total             {_gib(self.weights_per_device):>10}  (one full copy: "
               f"{_gib(self.weights_global)})")
    for name, b in self.cache.items():
      out.append(f"  cache / {name:<17} {_gib(b):>10}")
    out.append(f"  cache total               {_gib(self.cache_per_device):>10}  (global {_gib(self.cache_global)}; "
               f"{self.kv_heads_stored} KV heads stored per layer)")
    out.append(f"  weights + cache           {_gib(self.total_per_device):>10}  per device (activations and "
               "compiler workspace not included)")
    split = (f" + the fp32 experts' bf16 split for the MoE kernels ({_gib(self.split_experts)})"
             if self.split_experts else "")
    out.append(f"  decode-loop workspace     {_gib(self.decode_workspace):>10}  per device: each layer's q / k / v "
               f"(/ index) weights concatenated{split}, held while a decode loop runs or a Decoder lives")
    out.extend(f"  note: {note}" for note in self.notes)
    return out


def _gib(b: float) -> str:
  from m3jax.checkpoint.fsutil import format_bytes  # pylint: disable=g-import-not-at-top

  return format_bytes(b)  # decimal units, as GPU memory is quoted (H200: 141 GB)


def _component(path: tuple[Any, ...]) -> str:
  from m3jax.checkpoint.inspect import component  # pylint: disable=g-import-not-at-top

  return component(path)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # under 'attn' (and its 'indexer'): m3jax.parallel.projection fuses them


@functools.lru_cache(maxsize=4)
def _abstract_params(config: Any, dtype: Any, with_mtp: bool = False, quantized: tuple = ()
                     ) -> tuple[tuple[str, tuple[int, ...], Any, tuple[Any, ...], bool, bool, bool], ...]:
  """(component, shape, dtype, logical names, fused input projection (0: no, 1: float, 2: fp8 values / scales), is
  a float routed-expert weight, is fp8 scales) of every parameter the loader would build (``quantized``: (path, QuantSpec) pairs kept in fp8)."""
  from m3jax.checkpoint.loader import abstract_model  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint.mapping import EXPERT_PARAMS  # pylint: disable=g-import-not-at-top
  from m3jax.sharding import is_scales  # pylint: disable=g-import-not-at-top

  _, flat = abstract_model(config, dtype, with_mtp=with_mtp, quantized=dict(quantized) or None)
  def projection(path) -> int:  # 1: a float input projection; 2: an fp8 one's values or scales
    if "attn" not in path:
      return 0
    if path[-1] in _PROJECTIONS:
      return 1
    return 2 if len(path) > 1 and path[-2] in _PROJECTIONS and path[-1] in ("values", "scales") else 0

  return tuple((_component(path), tuple(var.shape), var.dtype,
                tuple(var.get_metadata().get("out_sharding") or (None,) * len(var.shape)),
                projection(path), path[-1] in EXPERT_PARAMS, is_scales(var))
               for path, var in flat)


def plan_memory(config: Any, mesh: Mapping[str, int] | str | Any, *, batch: int, context: int,
                dtype: Any = jnp.bfloat16, expert_bytes: float | None = None, cache_dtype: Any = None,
                rules: Rules = RULES, with_mtp: bool = False, quantized: Mapping | None = None) -> MemoryPlan:
  """Weight and cache bytes per device.

  Args:
    config: M3Config.
    mesh: a Mesh, {'expert': 8}, or 'data=1,expert=8,tensor=1'.
    batch, context: cache size (sequences x tokens).
    dtype: parameter dtype (router weights / correction biases stay fp32, as in the model).
    expert_bytes: bytes per routed-expert weight if different (e.g. FP8_BYTES: a forecast of MXFP8 experts
      from the shapes alone; ``quantized`` plans the real thing).
    cache_dtype: KV / index-key cache dtype (default: dtype).
    with_mtp: include the MTP modules (weights as "MTP module", their sparse-layer caches as "MTP cache") that
      speculative decoding loads.
    quantized: {parameter path: QuantSpec} of the weights kept in fp8 (``m3jax.load(..., keep_quantized=True)``,
      ``m3jax.checkpoint.fp8_params``): their values and scales are counted as stored and laid out.
  """
  sizes = mesh_sizes(mesh)
  check_config(config, sizes, rules)
  weights: dict[str, float] = {}
  total = fused = mtp_experts = 0.0
  quantized_items = tuple(sorted((quantized or {}).items(), key=lambda kv: tuple(map(str, kv[0]))))
  for comp, shape, param_dtype, names, projection, expert, scales in _abstract_params(
      config, jnp.dtype(dtype), with_mtp, quantized_items):
    itemsize = np.dtype(param_dtype).itemsize
    if expert_bytes is not None and comp == "routed experts":
      itemsize = expert_bytes
    spec = logical_spec(names, sizes, rules)
    spec = fit_spec(spec, shape, sizes) if scales else spec
    split = math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
    nbytes = math.prod(shape) * itemsize
    total += nbytes
    weights[comp] = weights.get(comp, 0.0) + nbytes / split
    # fp8 projections are fused for decode on one device only (m3jax.layers.fused_quantized)
    fused += nbytes / split if projection == 1 or (projection == 2 and math.prod(sizes.values()) == 1) else 0.0
    mtp_experts += nbytes / split if expert and comp == "MTP module" else 0.0
  # fp32 weights run the MoE kernels through a bf16 [hi; lo; hi] copy (3 x 2 bytes per 4-byte weight), which a
  # decode loop prepares once: the routed experts, and the shared expert where it runs in the kernels (one device).
  split_experts = 0.0
  if jnp.dtype(dtype) == jnp.float32 and expert_bytes is None and not any(
      str(p[-1]) in ("w_gate_up", "w_down") for p in (quantized or {})):  # fp8 experts are read as they are
    split_experts = 1.5 * (weights.get("routed experts", 0.0) + mtp_experts)
    if math.prod(sizes.values()) == 1:
      split_experts += 1.5 * weights.get("shared experts", 0.0)
  t = config.text
  heads_ranks = math.prod(sizes[a] for a in spec_axes(logical_spec((ax.ACT_HEADS,), sizes, rules)[0]))
  kv_heads = t.num_kv_heads * (heads_ranks // t.num_kv_heads if heads_ranks > t.num_kv_heads else 1)
  cache_item = np.dtype(jnp.dtype(cache_dtype or dtype)).itemsize
  kv_axes = (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_HEADS, ax.CACHE_DIM)
  kv_shape = (batch, context, kv_heads, t.head_dim)
  idx_axes = (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_DIM)
  idx_shape = (batch, context, t.index_head_dim)

  def per_device(names, shape) -> tuple[float, float]:
    spec = logical_spec(names, sizes, rules, shape)
    split = math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
    full = math.prod(shape) * cache_item
    return full / split, full

  kv_dev, kv_full = per_device(kv_axes, kv_shape)
  idx_dev, idx_full = per_device(idx_axes, idx_shape)
  n_sparse = t.num_sparse_layers
  cache = {"kv": 2 * t.num_layers * kv_dev, "index keys": n_sparse * idx_dev}
  global_cache = (2 * t.num_layers * kv_full * t.num_kv_heads / kv_heads + n_sparse * idx_full)
  if with_mtp:  # one sparse layer's KV + index-key cache per MTP module
    cache["MTP cache"] = t.num_mtp_modules * (2 * kv_dev + idx_dev)
    global_cache += t.num_mtp_modules * (2 * kv_full * t.num_kv_heads / kv_heads + idx_full)
  notes = []
  if kv_heads > t.num_kv_heads:
    notes.append(f"tensor axis ({heads_ranks}) > {t.num_kv_heads} KV heads: each KV / index head is replicated "
                 f"{kv_heads // t.num_kv_heads}x (vLLM), each device stores {kv_heads // heads_ranks} KV head(s)")
  if expert_bytes is not None:
    notes.append(f"routed experts at {expert_bytes:g} bytes/weight (a forecast from the shapes; --keep-quantized / "
                 "--quantize plan the weights kept in fp8)")
  if quantized:
    fmts = sorted({spec.fmt for spec in quantized.values()})
    notes.append(f"{len(quantized)} linear weights kept in fp8 ({', '.join(fmts)}): values 1 byte per weight plus "
                 "their scales")
  return MemoryPlan(mesh=sizes, batch=batch, context=context, weights={k: int(v) for k, v in weights.items()},
                    weights_global=int(total), cache={k: int(v) for k, v in cache.items()},
                    cache_global=int(global_cache), kv_heads_stored=kv_heads, fused_projections=int(fused),
                    split_experts=int(split_experts), notes=tuple(notes))
