"""Dense projections and the dense MLP with block-scaled fp8 weights (``pallas_kernels.quant.QuantizedWeight``)
behind the kernel dispatch: ``pallas_kernels.linear``'s kernels where they exist, their pure-jnp references
otherwise."""

from __future__ import annotations

import jax

from m3jax import sharding
from m3jax.ops.dispatch import KernelChoice, run_op
from pallas_kernels.linear.reference import quantized_gated_mlp_reference, quantized_matmul_reference
from pallas_kernels.quant import QuantizedWeight


def _multi_device() -> bool:
  plan = sharding.current_plan()
  return plan is not None and not plan.is_trivial


def quantized_linear(x: jax.Array, w: QuantizedWeight, *, kernels: KernelChoice) -> jax.Array:
  """x [T, in] @ w [out, in].T -> [T, out] in x.dtype (fp32 accumulation).

  Under a multi-device sharding plan the reference runs (the compiler partitions it like the bf16 einsum; a
  kernel would need a per-device wrapper, which comes with the kernel).
  """
  if _multi_device():
    return quantized_matmul_reference(x, w)
  return run_op(kernels, kernel_module="pallas_kernels.linear", kernel_name="quantized_matmul",
                reference=quantized_matmul_reference, args=(x, w), kwargs={})


def quantized_mlp(x: jax.Array, w_gate_up: QuantizedWeight, w_down: QuantizedWeight, *, alpha: float, limit: float,
                  kernels: KernelChoice) -> jax.Array:
  """Dense SwiGLU-OAI MLP: x [T, H] with gate_up [2F, H] / down [H, F] -> [T, H] in x.dtype
  (``pallas_kernels.linear.quantized_gated_mlp``; the reference under a multi-device plan, as above)."""
  kwargs = dict(alpha=alpha, limit=limit)
  if _multi_device():
    return quantized_gated_mlp_reference(x, w_gate_up, w_down, **kwargs)
  return run_op(kernels, kernel_module="pallas_kernels.linear", kernel_name="quantized_gated_mlp",
                reference=quantized_gated_mlp_reference, args=(x, w_gate_up, w_down), kwargs=kwargs)
