"""Dense projection by a block-scaled fp8 weight (``pallas_kernels.quant.QuantizedWeight``) behind the kernel
dispatch: ``pallas_kernels.linear.quantized_matmul`` where it exists, its pure-jnp reference otherwise."""

from __future__ import annotations

import jax

from m3jax import sharding
from m3jax.ops.dispatch import KernelChoice, run_op
from pallas_kernels.linear.reference import quantized_matmul_reference
from pallas_kernels.quant import QuantizedWeight


def quantized_linear(x: jax.Array, w: QuantizedWeight, *, kernels: KernelChoice) -> jax.Array:
  """x [T, in] @ w [out, in].T -> [T, out] in x.dtype (fp32 accumulation).

  Under a multi-device sharding plan the reference runs (the compiler partitions it like the bf16 einsum; a
  kernel would need a per-device wrapper, which comes with the kernel).
  """
  plan = sharding.current_plan()
  if plan is not None and not plan.is_trivial:
    return quantized_matmul_reference(x, w)
  return run_op(kernels, kernel_module="pallas_kernels.linear", kernel_name="quantized_matmul",
                reference=quantized_matmul_reference, args=(x, w), kwargs={})
