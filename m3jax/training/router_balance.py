"""Auxiliary-loss-free router balancing (DeepSeek-V3's bias update) for M3's ``e_score_correction_bias``.

M3 routes by sigmoid(router logits) + correction bias, the bias steering selection only (M3_SPEC §2.7). After
every optimizer step each MoE layer's bias moves by ``rate`` towards balance: up for experts that received
fewer than the mean share of the batch's token-slots, down for those that received more,
``b_e += rate * sign(1/E - load_e)``. No loss term: the gradient never sees the bias (the optimizer leaves it
alone, see m3jax.training.optimizer), so the language-model objective is untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """expert_ids int [B, S, K] (a layer's routing record) -> fp32 [E]: each expert's share of the B*S*K slots."""
  counts = jnp.sum(jax.nn.one_hot(expert_ids.reshape(-1), num_experts, dtype=jnp.float32), axis=0)
  return counts / expert_ids.size


def balanced_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """The correction bias [E] after one balancing step for this load [E] (shares summing to 1)."""
  error = 1.0 / load.shape[0] - load
  return (bias + rate * jnp.sign(error)).astype(bias.dtype)


def max_load_ratio(load: jax.Array) -> jax.Array:
  """The busiest expert's share over the mean share (1 = perfectly balanced, E = everything on one expert)."""
  return jnp.max(load) * load.shape[-1]
