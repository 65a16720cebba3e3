"""Several projections of one input as one GEMM: the weights are concatenated along their output columns
(per device under ``shard_map`` when a plan is active) and the product is split back.

Why explicitly: XLA:GPU's dot merger already merges the five projections of a layer's normed input (q, k, v,
index q, index k) into one GEMM, but it does so after loop optimisations, so its weight concatenation (18.9 MB
per sparse layer of an 8-way shard, 12.7 us) runs on every step of an on-device decode loop (BENCHMARKS.md,
"Fewer launches per decode layer"). Written in the program, the concatenation of loop-invariant weights is
hoisted out of the loop by XLA's loop-invariant code motion and paid once per ``generate`` call.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax import logical_axes as ax
from m3jax.layers.params import project
from m3jax.sharding import current_plan


def _local(x: jax.Array, weights: Sequence[jax.Array]) -> list[jax.Array]:
  """x [B,S,H] and weights [H, N_i, D_i] -> [B,S,N_i,D_i] in x.dtype, from one GEMM over the concatenated weights."""
  widths = [w.shape[1] * w.shape[2] for w in weights]
  fused = jnp.concatenate([w.reshape(w.shape[0], -1) for w in weights], axis=1)
  y = project("bsh,hc->bsc", x, fused)
  outs, start = [], 0
  for w, width in zip(weights, widths):
    outs.append(y[..., start:start + width].reshape(*x.shape[:2], *w.shape[1:]))
    start += width
  return outs


def fused_projection(x: jax.Array, weights: Sequence[jax.Array],
                     weight_axes: Sequence[Sequence[str | None]]) -> list[jax.Array]:
  """``[project("bsh,hnd->bsnd", x, w) for w in weights]`` as one GEMM.

  Args:
    x: [B, S, H] activations, laid out as (act_batch, act_q_seq, act_embed) under a plan.
    weights: [H, N_i, D_i] each, same H.
    weight_axes: the logical axes of each weight (as in ``make_param``), which give its per-device slice.

  Returns:
    [B, S, N_i, D_i] in x.dtype per weight, each sharded like its weight's (N, D) axes.

  Falls back to one GEMM per weight when a plan splits H (the concatenation would not be per device).
  """
  plan = current_plan()
  if plan is None or plan.is_trivial:
    return _local(x, weights)
  x_spec = plan.spec((ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_EMBED), x.shape)
  w_specs = [plan.spec(names, w.shape) for w, names in zip(weights, weight_axes)]
  if x_spec[2] is not None or any(s[0] is not None for s in w_specs):
    return [project("bsh,hnd->bsnd", x, w) for w in weights]
  out_specs = [P(x_spec[0], x_spec[1], s[1], s[2]) for s in w_specs]
  return jax.shard_map(_local, mesh=plan.mesh, in_specs=(x_spec, w_specs), out_specs=out_specs,
                       check_vma=False)(x, list(weights))
