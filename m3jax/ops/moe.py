"""MoE block op (routing + routed experts + shared expert) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax import sharding
from m3jax.ops.dispatch import KernelChoice, run_op
from m3jax.parallel import moe as parallel_moe
from pallas_kernels.moe.reference import moe_block_reference


def moe_block(x: jax.Array, router_w: jax.Array, correction_bias: jax.Array, w_gate_up: jax.Array,
              w_down: jax.Array, shared_gate_up: jax.Array, shared_down: jax.Array, *, top_k: int,
              routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float,
              kernels: KernelChoice) -> jax.Array:
  """x [..., H] (e.g. [B,S,H] or [T,H]) -> same shape; weights in the layout of pallas_kernels.moe.reference.

  Under a multi-device sharding plan, [B,S,H] inputs run expert-parallel (m3jax.parallel.moe).
  """
  kwargs = dict(top_k=top_k, routed_scaling_factor=routed_scaling_factor, swiglu_alpha=swiglu_alpha,
                swiglu_limit=swiglu_limit)
  plan = sharding.current_plan()
  if plan is not None and not plan.is_trivial and x.ndim == 3:
    return parallel_moe.moe_block(plan, x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up,
                                  shared_down, **kwargs, kernels=kernels)
  flat = x.reshape(-1, x.shape[-1])
  y = run_op(kernels, kernel_module="pallas_kernels.moe", kernel_name="moe_block", reference=moe_block_reference,
             args=(flat, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down), kwargs=kwargs)
  return y.reshape(x.shape)
