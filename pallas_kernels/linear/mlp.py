"""``quantized_gated_mlp``: a dense SwiGLU-OAI MLP (M3's dense layers, the shared expert alone) with fp8 weights.

x [T, H] -> down(swiglu_oai(x @ gate_up^T)) with ``QuantizedWeight`` gate_up [2F, H] (gate rows, then up rows)
and down [H, F], the checkpoint orientation. Two shapes of work:

* Decode (T <= 64) is bandwidth-bound, and one GPU's slice of M3's dense MLP has few 128-row output tiles (8-way:
  F = 1536, 12 gate/up tile pairs for 132 SMs). So gate_up runs ``quantized_matmul`` with its reduction split over
  the SMs and **fp32** output (the partial sums are added in fp32, never rounded), SwiGLU-OAI runs in fp32 in
  XLA, the activation is rounded to bf16 once, and down runs ``quantized_matmul``: the reference's arithmetic
  (``gated_mlp`` on the dequantized weights), up to the order of the fp32 additions.
* Prefill (T > 64) is compute-bound: one grouped-GEMM pair (``pallas_kernels.moe.fp8.dense_mlp_fp8``), gate_up
  with the SwiGLU epilogue on its fp32 accumulators (the [T, 2F] product never leaves the SMs), then down.
  Also the reference's arithmetic up to the order of the fp32 additions.

The pure-jnp reference is ``reference.quantized_gated_mlp_reference``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.linear.api import DECODE_MAX_TOKENS, quantized_matmul
from pallas_kernels.moe.fp8 import Fp8Gemms, dense_mlp_fp8
from pallas_kernels.moe.reference import swiglu_oai
from pallas_kernels.quant import QuantizedWeight


def check_mlp_weights(x: jax.Array, w_gate_up: QuantizedWeight, w_down: QuantizedWeight) -> None:
  """ValueError unless x is [T, H], gate_up [2F, H] and down [H, F] (quantized, one format)."""
  if not (isinstance(w_gate_up, QuantizedWeight) and isinstance(w_down, QuantizedWeight)):
    raise TypeError("quantized_gated_mlp takes QuantizedWeight gate_up and down")
  if x.ndim != 2:
    raise ValueError(f"x must be [T, H], got {x.shape}")
  h = x.shape[1]
  gu, dn = w_gate_up.shape, w_down.shape
  if len(gu) != 2 or gu[1] != h or gu[0] % 2 or dn != (h, gu[0] // 2):
    raise ValueError(f"quantized gate_up / down must be [2F, H={h}] / [H={h}, F], got {list(gu)} / {list(dn)}")
  if w_gate_up.fmt != w_down.fmt:
    raise ValueError(f"gate_up ({w_gate_up.fmt}) and down ({w_down.fmt}) must share a format")


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "interpret", "num_sms"))
def quantized_gated_mlp(x: jax.Array, w_gate_up: QuantizedWeight, w_down: QuantizedWeight, *, alpha: float,
                        limit: float, interpret: Any = False, num_sms: int | None = None) -> jax.Array:
  """x bf16 [T, H] -> bf16 [T, H] (module docstring).

  Raises:
    ValueError / TypeError: inconsistent shapes or weights. NotImplementedError: activations other than bf16, or
    widths the fp8 kernels do not tile (F and H multiples of 128).
  """
  check_mlp_weights(x, w_gate_up, w_down)
  if x.dtype != jnp.bfloat16:
    raise NotImplementedError(f"quantized_gated_mlp runs bf16 activations on the kernels, got {x.dtype}")
  t, h = x.shape
  if t == 0:
    return jnp.zeros((0, h), x.dtype)
  if t <= DECODE_MAX_TOKENS:
    gate_up = quantized_matmul(x, w_gate_up, interpret=interpret, num_sms=num_sms, out_dtype=jnp.float32)
    act = swiglu_oai(gate_up, alpha=alpha, limit=limit).astype(x.dtype)
    return quantized_matmul(act, w_down, interpret=interpret, num_sms=num_sms)
  gemms = Fp8Gemms.make(interpret, None, num_sms, t, h, w_down.shape[1], w_gate_up.fmt, alpha, limit)
  return dense_mlp_fp8(x, w_gate_up, w_down, gemms)
