"""MoE block op (routing + routed experts + shared expert) behind the kernel dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax import sharding
from m3jax.ops.dispatch import KernelChoice, run_op, runs_kernel
from m3jax.parallel import moe as parallel_moe
from pallas_kernels.moe.api import ExpertOperands, prepare_expert_weights
from pallas_kernels.moe.reference import moe_block_reference
from pallas_kernels.quant import QuantizedWeight


def prepare_experts(w_gate_up: jax.Array, w_down: jax.Array, shared_gate_up: jax.Array, shared_down: jax.Array, *,
                    kernels: KernelChoice) -> ExpertOperands | None:
  """The MoE kernels' operands for ``moe_block``'s ``prepared``, built once before a decode loop; None where
  nothing is gained: the reference path, or weights the kernels read as they are (bf16 / f16). fp32 weights
  get the kernels' bf16 hi / lo split (1.5x their bytes), which XLA:GPU would otherwise recompute on every
  step of the loop (BENCHMARKS.md). The activations must have the weights' dtype (as in the model). Weights kept
  in fp8 (``QuantizedWeight``) are read as they are: None."""
  if any(isinstance(w, QuantizedWeight) for w in (w_gate_up, w_down, shared_gate_up, shared_down)):
    return None
  if w_gate_up.dtype != jnp.float32 or not runs_kernel(kernels):
    return None
  plan = sharding.current_plan()
  if plan is not None and not plan.is_trivial:  # the shared expert runs outside the kernels there
    return parallel_moe.prepare_routed(plan, w_gate_up, w_down)
  return prepare_expert_weights(jnp.float32, w_gate_up, w_down, shared_gate_up, shared_down)


def moe_block(x: jax.Array, router_w: jax.Array, correction_bias: jax.Array, w_gate_up: jax.Array,
              w_down: jax.Array, shared_gate_up: jax.Array, shared_down: jax.Array, *, top_k: int,
              routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float,
              kernels: KernelChoice, prepared: ExpertOperands | None = None) -> jax.Array:
  """x [..., H] (e.g. [B,S,H] or [T,H]) -> same shape; weights in the layout of pallas_kernels.moe.reference (each
  MLP weight an array or a ``QuantizedWeight``).

  Under a multi-device sharding plan, [B,S,H] inputs run expert-parallel (m3jax.parallel.moe). ``prepared``:
  ``prepare_experts(...)`` of the same weights under the same plan, built once for many calls; the kernels use
  it instead of preparing their operands per call (the reference ignores it).
  """
  kwargs = dict(top_k=top_k, routed_scaling_factor=routed_scaling_factor, swiglu_alpha=swiglu_alpha,
                swiglu_limit=swiglu_limit)
  plan = sharding.current_plan()
  if plan is not None and not plan.is_trivial and x.ndim == 3:
    return parallel_moe.moe_block(plan, x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up,
                                  shared_down, **kwargs, kernels=kernels, prepared=prepared)
  flat = x.reshape(-1, x.shape[-1])
  y = run_op(kernels, kernel_module="pallas_kernels.moe", kernel_name="moe_block", reference=moe_block_reference,
             args=(flat, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down), kwargs=kwargs,
             kernel_kwargs=None if prepared is None else dict(prepared=prepared))
  return y.reshape(x.shape)
