"""Linear weights kept in a checkpoint's quantized form (MXFP8 / FP8-block / NVFP4, M3_SPEC §6) inside the model.

A quantized weight replaces its ``nnx.Param`` by a ``QuantizedLinear`` module with two parameters:

  values: float8_e4m3fn [*batch, out, in]   (the checkpoint orientation; ``pallas_kernels.quant``)
  scales: uint8 E8M0 or float32 [*batch, ceil(out / bo), ceil(in / bi)]

(NVFP4: values uint8 [*batch, out, in / 2], scales float8_e4m3fn [*batch, out, in / 16] and a third parameter,
``global_scale`` fp32 [*batch, P], the multipliers of the P row parts; m3jax keeps only the routed experts in it)
where the bf16 parameter it stands for is [*batch, *in_dims, *out_dims] (m3jax's layout, e.g. q_proj [H, Nq, D] ->
values [Nq * D, H]; o_proj [Nq, D, H] -> values [H, Nq * D]; experts w_gate_up [E, H, 2I] -> values [E, 2I, H]).
Logical axes: each of batch / out / in takes the bf16 parameter's name of that dimension (for merged dims, the
outermost one's: sharding Nq * D by heads is sharding it by its outer factor); the scales carry the same names
(their dims that a mesh axis does not divide stay replicated: ``m3jax.sharding.param_spec``). ``fmt`` / ``block``
are static module attributes, and ``weight()`` builds the ``QuantizedWeight`` the ops take.

Which parameters are quantized is a ``{param path: QuantSpec}`` mapping (from the checkpoint, or
``quantize_all``); ``M3ForCausalLM(..., quantized=specs)`` builds the model with them (``apply_quantized``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.layers.params import project
from m3jax.ops.dispatch import KernelChoice
from m3jax.ops.linear import quantized_linear
from m3jax.sharding import SCALES_METADATA
from pallas_kernels.quant import (PACKED_DTYPE, QuantizedWeight, check_quantized, default_block, quantize,
                                  scale_grid, values_shape_of)

ParamPath = tuple[Any, ...]
# The linear weights that may be kept quantized, by their attribute name: the number of leading input dims of the
# bf16 parameter after its batch dims (o_proj [Nq, D, H] has two).
QUANTIZABLE: dict[str, int] = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_up": 1, "down": 1,
                               "w_gate_up": 1, "w_down": 1}
BATCHED = ("w_gate_up", "w_down")  # stacked experts [E, ...]


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How one parameter is kept: ``fmt`` ('mxfp8' | 'fp8_block' | 'nvfp4'), the scales' ``block`` (rows, cols) in
  the parameter (fp8_block rows may be finer than the checkpoint's where gate / up are concatenated:
  ``pallas_kernels.quant.concat_block``), ``scale_dtype`` ('uint8' E8M0 | 'float32' | 'float8_e4m3fn' for nvfp4),
  the checkpoint tensors' own ``source_block`` (export writes it back) and, for nvfp4, ``parts``: the row parts
  with their own global scale (the checkpoint tensors concatenated along out, e.g. 2 for gate_up)."""

  fmt: str
  block: tuple[int, int]
  scale_dtype: str
  source_block: tuple[int, int]
  parts: int = 1

  @classmethod
  def of(cls, fmt: str, scale_dtype: str | None = None) -> "QuantSpec":
    """The plain spec of a format (default block; mxfp8 scales are E8M0, fp8_block's float32 by default)."""
    block = default_block(fmt)
    default = {"mxfp8": "uint8", "nvfp4": "float8_e4m3fn"}.get(fmt, "float32")
    return cls(fmt, block, scale_dtype or default, block)

  def to_json(self) -> dict[str, Any]:
    d = {"fmt": self.fmt, "block": list(self.block), "scale_dtype": self.scale_dtype,
         "source_block": list(self.source_block)}
    return d | ({"parts": self.parts} if self.fmt == "nvfp4" else {})

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "QuantSpec":
    return cls(str(d["fmt"]), tuple(d["block"]), str(d["scale_dtype"]), tuple(d["source_block"]),
               int(d.get("parts", 1)))


def is_quantizable(path: ParamPath) -> bool:
  """Whether the parameter at ``path`` is a linear weight the model can keep quantized (decoder and MTP layers'
  attention / indexer projections, dense and shared MLPs, routed experts; not the router, norms, embeddings,
  LM head, MTP eh_proj or the vision tower)."""
  return bool(path) and path[0] in ("layers", "mtp") and str(path[-1]) in QUANTIZABLE


def geometry(path: ParamPath, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """(batch dims, input dims, output dims) of the bf16 parameter at ``path`` of ``shape``."""
  n_batch = 1 if str(path[-1]) in BATCHED else 0
  n_in = QUANTIZABLE[str(path[-1])]
  return shape[:n_batch], shape[n_batch:n_batch + n_in], shape[n_batch + n_in:]


def quantized_shapes(path: ParamPath, shape: tuple[int, ...], spec: QuantSpec
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(values shape, scales shape) of the bf16 parameter at ``path`` of ``shape`` kept with ``spec`` (nvfp4: the
  packed values [*batch, out, in / 2]; its global scale is [*batch, spec.parts])."""
  batch, inp, out = geometry(path, shape)
  weight = (*batch, math.prod(out), math.prod(inp))
  return values_shape_of(weight, spec.fmt), scale_grid(weight, spec.fmt, spec.block)


def _outer(names: tuple[str | None, ...]) -> str | None:
  return names[0] if names else None


class QuantizedLinear(nnx.Module):
  """An fp8 linear weight (see the module docstring): ``values`` / ``scales`` parameters, ``fmt`` / ``block``.

  Args:
    weight: the bf16 / fp32 weight it replaces, [*batch, *in_dims, *out_dims] (quantized here with the reference
      quantizer; a loader overwrites values and scales).
    axes: that weight's logical axis names.
    batch_dims, in_dims: how many of its leading dims are batch (experts) and input dims.
    spec: the format.
  """

  def __init__(self, weight: jax.Array, axes: tuple[str | None, ...], *, batch_dims: int, in_dims: int,
               spec: QuantSpec):
    shape = tuple(weight.shape)
    batch, inp = shape[:batch_dims], shape[batch_dims:batch_dims + in_dims]
    out = shape[batch_dims + in_dims:]
    self.in_shape, self.out_shape = tuple(inp), tuple(out)
    self.fmt, self.block = spec.fmt, tuple(spec.block)
    w = jnp.swapaxes(weight.reshape(*batch, math.prod(inp), math.prod(out)), -1, -2)
    if spec.fmt == "nvfp4":
      q = quantize(w, "nvfp4", parts=spec.parts)
    else:
      q = quantize(w, spec.fmt, tuple(spec.block), jnp.dtype(spec.scale_dtype))
    b_axes, i_axes, o_axes = axes[:batch_dims], axes[batch_dims:batch_dims + in_dims], axes[batch_dims + in_dims:]
    names = (*b_axes, _outer(o_axes), _outer(i_axes))
    self.values = nnx.Param(q.values, out_sharding=names, eager_sharding=False)
    self.scales = nnx.Param(q.scales, out_sharding=names, eager_sharding=False, **{SCALES_METADATA: True})
    if spec.fmt == "nvfp4":  # [*batch, parts]: the batch axes' names, the parts replicated
      self.global_scale = nnx.Param(q.global_scale, out_sharding=(*b_axes, None), eager_sharding=False,
                                    **{SCALES_METADATA: True})

  def weight(self) -> QuantizedWeight:
    """The ``QuantizedWeight`` [*batch, out, in] the ops read."""
    g = self.global_scale[...] if self.fmt == "nvfp4" else None
    return QuantizedWeight(self.values[...], self.scales[...], self.fmt, self.block, g)

  def __call__(self, x: jax.Array, *, kernels: KernelChoice) -> jax.Array:
    """x [..., *in_dims] -> [..., *out_dims] in x.dtype (a non-batched weight)."""
    n_in = len(self.in_shape)
    if tuple(x.shape[x.ndim - n_in:]) != self.in_shape:
      raise ValueError(f"input {x.shape} does not end with the weight's input dims {self.in_shape}")
    lead = x.shape[:x.ndim - n_in]
    y = quantized_linear(x.reshape(-1, math.prod(self.in_shape)), self.weight(), kernels=kernels)
    return y.reshape(*lead, *self.out_shape)


Weight = nnx.Param | QuantizedLinear


def weight_of(w: Weight) -> jax.Array | QuantizedWeight:
  """A parameter's array, or a QuantizedLinear's ``QuantizedWeight`` (what the MoE / MLP ops take)."""
  return w.weight() if isinstance(w, QuantizedLinear) else w[...]


def linear(x: jax.Array, w: Weight, eq: str, *, kernels: KernelChoice) -> jax.Array:
  """``project(eq, x, w)`` for a parameter in m3jax's layout; the fp8 projection for a QuantizedLinear (``eq``
  then only documents the dims: x [..., *in_dims] -> [..., *out_dims])."""
  if isinstance(w, QuantizedLinear):
    return w(x, kernels=kernels)
  return project(eq, x, w[...])


def is_quantized(*weights: Any) -> bool:
  """Whether any of ``weights`` is kept in fp8."""
  return any(isinstance(w, QuantizedLinear) for w in weights)


def apply_quantized(model: nnx.Module, specs: Mapping[ParamPath, QuantSpec]) -> None:
  """Replaces the parameter at each path of ``specs`` by a QuantizedLinear (quantizing its current value)."""
  for path, spec in specs.items():
    if not is_quantizable(path):
      raise ValueError(f"parameter {'/'.join(map(str, path))} cannot be kept quantized (quantizable: the decoder "
                       f"and MTP layers' {', '.join(QUANTIZABLE)})")
    parent = model
    for key in path[:-1]:
      parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    param = getattr(parent, path[-1], None)
    if not isinstance(param, nnx.Param):
      raise ValueError(f"no parameter at {'/'.join(map(str, path))} to keep quantized")
    batch, inp, _ = geometry(path, tuple(param.shape))
    names = param.get_metadata().get("out_sharding") or (None,) * len(param.shape)
    name = "/".join(map(str, path))
    if spec.fmt == "nvfp4" and str(path[-1]) not in BATCHED:
      raise ValueError(f"parameter {name}: nvfp4 is kept for the routed experts only ({', '.join(BATCHED)})")
    values_shape, scales_shape = quantized_shapes(path, tuple(param.shape), spec)
    values_dtype = PACKED_DTYPE if spec.fmt == "nvfp4" else jnp.float8_e4m3fn
    check_quantized(values_shape, values_dtype, scales_shape, jnp.dtype(spec.scale_dtype), spec.fmt, spec.block,
                    name=name)
    if spec.fmt == "nvfp4" and values_shape[-2] % spec.parts:
      raise ValueError(f"parameter {name}: {values_shape[-2]} output rows do not split into {spec.parts} parts")
    setattr(parent, path[-1], QuantizedLinear(param[...], tuple(names), batch_dims=len(batch), in_dims=len(inp),
                                              spec=spec))


def quantize_all(paths: Iterable[ParamPath], fmt: str = "mxfp8") -> dict[ParamPath, QuantSpec]:
  """Specs that keep every quantizable parameter among ``paths`` in ``fmt`` (what ``m3jax convert --quantize``
  writes): decoder and MTP layers' linear weights; the MTP eh_proj, routers, norms, embeddings, LM head and the
  vision tower stay as they are. (``convert --quantize`` leaves the MTP modules out: they are stored apart.)"""
  spec = QuantSpec.of(fmt)
  return {tuple(p): spec for p in paths if is_quantizable(tuple(p))}
