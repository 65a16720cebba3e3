"""Dense SwiGLU-OAI MLP (dense layers and the shared expert) and the MoE block (M3_SPEC §2.5-2.7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.config import TextConfig
from m3jax.layers.params import make_param
from m3jax.layers.quantized import weight_of
from m3jax.ops import moe as moe_ops
from m3jax.ops.dispatch import KernelChoice
from m3jax.ops.linear import quantized_mlp
from pallas_kernels.moe.reference import gated_mlp, route_reference
from pallas_kernels.quant import QuantizedWeight


class DenseMLP(nnx.Module):
  """x -> down(swiglu_oai(x @ gate_up)); gate_up [H, 2F] holds the gate columns first, then up.

  Either weight may be kept in fp8 (``m3jax.layers.quantized``). Both in fp8: ``m3jax.ops.linear.quantized_mlp``
  (the fp8 kernels with ``kernels``; the fp32 gate_up output feeds SwiGLU as in the bf16 path). One of them: the
  reference on the dequantized weight. (As the MoE block's shared expert, only the weights are used.)"""

  def __init__(self, hidden: int, width: int, *, alpha: float, limit: float, dtype: jnp.dtype,
               rngs: nnx.Rngs | None, kernels: KernelChoice = "reference"):
    self.alpha, self.limit = alpha, limit
    self.kernels = kernels
    self.gate_up = make_param(rngs, (hidden, 2 * width), dtype, (ax.EMBED, ax.MLP))
    self.down = make_param(rngs, (width, hidden), dtype, (ax.MLP, ax.EMBED))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., H] -> [..., H]."""
    flat = x.reshape(-1, x.shape[-1])
    gate_up, down = weight_of(self.gate_up), weight_of(self.down)
    if isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight):
      y = quantized_mlp(flat, gate_up, down, alpha=self.alpha, limit=self.limit, kernels=self.kernels)
    else:
      y = gated_mlp(flat, gate_up, down, alpha=self.alpha, limit=self.limit)
    return y.reshape(x.shape)


class MoE(nnx.Module):
  """Sigmoid-routed top-k experts (fp32 router, selection-only bias, renormalised weights, routed scale)
  plus an ungated shared expert."""

  def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, kernels: KernelChoice, rngs: nnx.Rngs | None):
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    self.kernels = kernels
    self.top_k = cfg.num_experts_per_tok
    self.scale = cfg.routed_scaling_factor
    self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
    self.router = make_param(rngs, (h, e), jnp.float32, (ax.EMBED, None))
    self.correction_bias = make_param(rngs, (e,), jnp.float32, (None,), init="zeros")
    self.w_gate_up = make_param(rngs, (e, h, 2 * i), dtype, (ax.EXPERTS, ax.EMBED, ax.EXPERT_MLP))
    self.w_down = make_param(rngs, (e, i, h), dtype, (ax.EXPERTS, ax.EXPERT_MLP, ax.EMBED))
    self.shared = DenseMLP(h, cfg.shared_intermediate_size, alpha=self.alpha, limit=self.limit, dtype=dtype,
                           rngs=rngs, kernels=kernels)

  def __call__(self, x: jax.Array, prepared: moe_ops.ExpertOperands | None = None) -> jax.Array:
    """x [B, S, H] -> [B, S, H]. ``prepared``: ``prepared_experts()`` built once outside a decode loop."""
    return moe_ops.moe_block(
        x, self.router[...], self.correction_bias[...], weight_of(self.w_gate_up), weight_of(self.w_down),
        weight_of(self.shared.gate_up), weight_of(self.shared.down), top_k=self.top_k, routed_scaling_factor=self.scale,
        swiglu_alpha=self.alpha, swiglu_limit=self.limit, kernels=self.kernels, prepared=prepared)

  def prepared_experts(self) -> moe_ops.ExpertOperands | None:
    """The MoE kernels' operands of this layer's experts, to build once before a decode loop and pass to every
    step (``__call__``'s ``prepared``); None where the kernels would not gain (reference path, bf16 weights).
    For fp32 weights they hold the bf16 hi / lo split: 1.5x the expert weights' bytes while the loop runs."""
    return moe_ops.prepare_experts(weight_of(self.w_gate_up), weight_of(self.w_down), weight_of(self.shared.gate_up),
                                   weight_of(self.shared.down), kernels=self.kernels)

  def routing(self, x: jax.Array) -> dict[str, jax.Array]:
    """Router intermediates for x [B, S, H]: router_logits fp32 [B,S,E], expert_ids int32 [B,S,K],
    expert_weights fp32 [B,S,K] (the same routing function the MoE op applies)."""
    b, s, _ = x.shape
    weights, ids, logits = route_reference(x.reshape(b * s, -1), self.router[...], self.correction_bias[...],
                                           top_k=self.top_k)
    return {"router_logits": logits.reshape(b, s, -1), "expert_ids": ids.reshape(b, s, -1),
            "expert_weights": weights.reshape(b, s, -1)}
