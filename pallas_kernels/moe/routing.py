"""Sigmoid top-k routing for the kernel path: ``route_reference``'s contract, fewer launches at decode sizes.

On GPU, ``lax.top_k`` over [T, E] lowers to a sort (plus a select fusion) even for one token. For small T
the top-k is computed instead by ranking all pairs of experts, [T, E, E] comparisons in two small fused
reductions; ties go to the lower expert index, as ``lax.top_k`` orders them. Everything after the ranking is
elementwise, so XLA fuses it into the MoE combine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import route_reference, router_scores

_ALL_PAIRS_MAX_ELEMS = 1 << 22  # T * E * E up to this: all-pairs ranking (T <= 256 at E = 128)


def top_k_all_pairs(values: jax.Array, k: int) -> jax.Array:
  """Indices of the k largest values of each row, largest first (ties: lower index first).

  Args:
    values: [T, E] (fp32).
    k: 1 <= k <= E.

  Returns:
    int32 [T, k], equal to ``lax.top_k(values, k)[1]`` for non-NaN values.
  """
  e = values.shape[-1]
  idx = jnp.arange(e, dtype=jnp.int32)
  other, this = values[:, None, :], values[:, :, None]  # [T, E (this), E (other)]
  beats = (other > this) | ((other == this) & (idx[None, None, :] < idx[None, :, None]))
  rank = jnp.sum(beats, axis=2, dtype=jnp.int32)  # [T, E]: how many experts come before this one
  slot = jnp.arange(k, dtype=jnp.int32)
  return jnp.sum(jnp.where(rank[:, None, :] == slot[None, :, None], idx[None, None, :], 0), axis=2,
                 dtype=jnp.int32)


def route(
    x: jax.Array, router_w: jax.Array, correction_bias: jax.Array, *, top_k: int
) -> tuple[jax.Array, jax.Array]:
  """``route_reference`` (fp32 logits, sigmoid, selection-only bias, renormalised weights) without the logits.

  Returns:
    weights fp32 [T, K], expert_ids int32 [T, K].
  """
  t, e = x.shape[0], router_w.shape[1]
  if t * e * e > _ALL_PAIRS_MAX_ELEMS:
    weights, expert_ids, _ = route_reference(x, router_w, correction_bias, top_k=top_k)
    return weights, expert_ids
  _, scores = router_scores(x, router_w)
  expert_ids = top_k_all_pairs(scores + correction_bias.astype(jnp.float32), top_k)
  chosen = jnp.take_along_axis(scores, expert_ids, axis=-1)
  # The K-term sum unrolled into elementwise adds: gather + normalisation then fuse into their consumer
  # (the combine) instead of a reduction launch of their own.
  denom = chosen[:, :1]
  for k in range(1, top_k):
    denom = denom + chosen[:, k:k + 1]
  return chosen / denom, expert_ids
