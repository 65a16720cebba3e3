"""MoE block op (routing + routed experts + shared expert) behind the kernel dispatch."""

from __future__ import annotations

import jax

from m3jax.ops.dispatch import KernelChoice, run_op
from pallas_kernels.moe.reference import moe_block_reference


def moe_block(x: jax.Array, router_w: jax.Array, correction_bias: jax.Array, w_gate_up: jax.Array,
              w_down: jax.Array, shared_gate_up: jax.Array, shared_down: jax.Array, *, top_k: int,
              routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float,
              kernels: KernelChoice) -> jax.Array:
  """x [T,H] -> [T,H]; weights in the layout of pallas_kernels.moe.reference."""
  return run_op(kernels, kernel_module="pallas_kernels.moe", kernel_name="moe_block",
                reference=moe_block_reference,
                args=(x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down),
                kwargs=dict(top_k=top_k, routed_scaling_factor=routed_scaling_factor,
                            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit))
