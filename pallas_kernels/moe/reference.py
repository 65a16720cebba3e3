"""Pure-jnp reference of the M3 MoE block (M3_SPEC §2.5-2.7).

Weights use the m3jax [in, out] layout:
  router_w [H, E] (fp32), correction_bias [E] (fp32),
  w_gate_up [E, H, 2I] (columns [0, I) gate, [I, 2I) up -- not interleaved), w_down [E, I, H],
  shared_gate_up [H, 2Is], shared_down [Is, H].
Any of the four MLP weights may instead be a ``pallas_kernels.quant.QuantizedWeight`` in the checkpoint
orientation [..., out, in]: w_gate_up [E, 2I, H] (gate rows first, then up), w_down [E, H, I], shared_gate_up
[2Is, H], shared_down [H, Is]. It is dequantized to the activations' dtype, then the math is the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quant import as_in_out


def swiglu_oai(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """SwiGLU-OAI on [..., 2F] (gate half first): (clip(u, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l).

  Computed in fp32; returns fp32 [..., F] (callers round once).
  """
  gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """Dense SwiGLU-OAI MLP: x [T, H] @ w_gate_up [H, 2F] -> act (fp32) -> @ w_down [F, H] -> [T, H] in x.dtype.

  (Quantized weights: w_gate_up [2F, H], w_down [H, F]; see the module docstring.)"""
  h = jnp.dot(x, as_in_out(w_gate_up, x.dtype), preferred_element_type=jnp.float32)
  a = swiglu_oai(h, alpha=alpha, limit=limit).astype(x.dtype)
  return jnp.dot(a, as_in_out(w_down, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def router_scores(x: jax.Array, router_w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """fp32 router logits [T, E] of x [T, H] and router_w [H, E], and their sigmoid scores [T, E]."""
  logits = jnp.dot(
      x.astype(jnp.float32), router_w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
  )
  return logits, jax.nn.sigmoid(logits)


def route_reference(
    x: jax.Array, router_w: jax.Array, correction_bias: jax.Array, *, top_k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sigmoid top-k routing.

  Args:
    x: [T, H] activations (any float dtype).
    router_w: [H, E], used in fp32 (fp32 logits from bf16 activations, as vLLM does).
    correction_bias: [E], added to the sigmoid scores for *selection only*.
    top_k: experts per token K.

  Returns:
    weights fp32 [T, K] (unbiased sigmoid of the chosen experts, renormalised over the K),
    expert_ids int32 [T, K], router_logits fp32 [T, E].
  """
  logits, scores = router_scores(x, router_w)
  _, expert_ids = jax.lax.top_k(scores + correction_bias.astype(jnp.float32), top_k)
  chosen = jnp.take_along_axis(scores, expert_ids, axis=-1)
  weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
  return weights, expert_ids.astype(jnp.int32), logits


def routed_experts_reference(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array | int = 0,
    *,
    alpha: float,
    limit: float,
) -> jax.Array:
  """Sum over the chosen experts held here of weight * expert(x), with real top-k dispatch (sort + grouped GEMM).

  The weights hold experts [first_expert, first_expert + E_local) (all of them by default; a slice of them
  under expert parallelism); assignments to other experts contribute exact zeros.

  Args:
    x: [T, H]; weights: fp32 [T, K]; expert_ids: int32 [T, K] (global ids); w_gate_up: [E_local, H, 2I];
    w_down: [E_local, I, H] (or QuantizedWeights [E_local, 2I, H] / [E_local, H, I]); first_expert: int32 scalar
    (may be traced, e.g. from an axis index).

  Returns:
    fp32 [T, H] (unscaled by routed_scaling_factor).
  """
  t, _ = x.shape
  k = expert_ids.shape[1]
  w_gate_up, w_down = as_in_out(w_gate_up, x.dtype), as_in_out(w_down, x.dtype)
  e_local = w_gate_up.shape[0]
  local_ids = expert_ids - first_expert
  held = (local_ids >= 0) & (local_ids < e_local)
  flat_ids = jnp.where(held, local_ids, e_local).reshape(-1)  # others sort past the last group
  order = jnp.argsort(flat_ids, stable=True)  # assignments grouped by expert
  token_of = order // k
  group_sizes = jnp.bincount(flat_ids, length=e_local).astype(jnp.int32)  # drops the others
  xs = x[token_of]
  hdn = jax.lax.ragged_dot(xs, w_gate_up, group_sizes, preferred_element_type=jnp.float32)
  act = swiglu_oai(hdn, alpha=alpha, limit=limit).astype(x.dtype)
  out = jax.lax.ragged_dot(act, w_down, group_sizes, preferred_element_type=jnp.float32)
  w = jnp.where(held, weights, 0.0).reshape(-1)[order]
  out = jnp.where((w != 0)[:, None], out * w[:, None], 0.0)  # rows past the groups are never read
  return jax.ops.segment_sum(out, token_of, num_segments=t)


@functools.partial(jax.jit, static_argnames=("top_k", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"))
def moe_block_reference(
    x: jax.Array,
    router_w: jax.Array,
    correction_bias: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    shared_gate_up: jax.Array,
    shared_down: jax.Array,
    *,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> jax.Array:
  """The whole M3 MoE block: routed_scaling_factor * sum_k w_k E_k(x) + Shared(x).

  Args:
    x: [T, H]; other weights as in the module docstring.

  Returns:
    [T, H] in x.dtype.
  """
  weights, expert_ids, _ = route_reference(x, router_w, correction_bias, top_k=top_k)
  routed = routed_experts_reference(
      x, weights, expert_ids, w_gate_up, w_down, alpha=swiglu_alpha, limit=swiglu_limit
  )
  shared = gated_mlp(x, shared_gate_up, shared_down, alpha=swiglu_alpha, limit=swiglu_limit)
  return (routed * routed_scaling_factor + shared.astype(jnp.float32)).astype(x.dtype)
