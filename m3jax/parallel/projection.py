"""Several projections of one input as one GEMM: the weights are concatenated along their output columns
(per device under ``shard_map`` when a plan is active) and the product is split back.

Why explicitly: XLA:GPU's dot merger already merges the five projections of a layer's normed input (q, k, v,
index q, index k) into one GEMM, but it does so after loop optimisations, so its weight concatenation (18.9 MB
per sparse layer of an 8-way shard, 12.7 us) runs on every step of an on-device decode loop (BENCHMARKS.md,
"Fewer launches per decode layer"). XLA:GPU does not hoist a concatenation written in the program out of the
loop either (the H200's compiled ``looped_steps`` kept it in the while body, eleventh session), so the split is
explicit: ``fuse_weights`` builds the fused weight once, before a decode loop, and ``project_fused`` uses it on
every step. ``fused_projection`` does both, for single calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax import logical_axes as ax
from m3jax.layers.params import project
from m3jax.sharding import current_plan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedWeights:
  """Projection weights concatenated along their output columns, per device.

  weight: [H, C], C = devices along ``column_axes`` x the per-device width (sum of the local N_i * D_i);
    device d's columns are its own slices of every weight, side by side.
  local_shapes: the per-device (N_i, D_i) of each weight, in order.
  column_axes: mesh axes the columns are split over (None without a plan, or when no slice differs).
  out_axes: the mesh axes of each output's (N, D) dims (as the weight's).
  """

  weight: jax.Array
  local_shapes: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))
  column_axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
  out_axes: tuple[tuple, ...] = dataclasses.field(default=(), metadata=dict(static=True))


def _concat_local(weights: Sequence[jax.Array]) -> jax.Array:
  return jnp.concatenate([w.reshape(w.shape[0], -1) for w in weights], axis=1)


def _split_local(y: jax.Array, local_shapes: Sequence[tuple[int, int]]) -> list[jax.Array]:
  outs, start = [], 0
  for n, d in local_shapes:
    outs.append(y[..., start:start + n * d].reshape(*y.shape[:2], n, d))
    start += n * d
  return outs


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def fuse_weights(weights: Sequence[jax.Array], weight_axes: Sequence[Sequence[str | None]]) -> FusedWeights | None:
  """Concatenate [H, N_i, D_i] weights (logical axes ``weight_axes``, as in ``make_param``) for ``project_fused``.

  Returns None when the active plan splits H: the concatenation would not be per device, and the caller
  should project with each weight on its own.
  """
  plan = current_plan()
  if plan is None or plan.is_trivial:
    return FusedWeights(_concat_local(weights), tuple((w.shape[1], w.shape[2]) for w in weights))
  specs = [plan.spec(names, w.shape) for w, names in zip(weights, weight_axes)]
  if any(s[0] is not None for s in specs):
    return None
  sizes = dict(plan.mesh.shape)
  local_shapes = tuple((w.shape[1] // math.prod(sizes[a] for a in _axes_of(s[1])),
                        w.shape[2] // math.prod(sizes[a] for a in _axes_of(s[2]))) for w, s in zip(weights, specs))
  used = {a for s in specs for a in _axes_of(s[1]) + _axes_of(s[2])}
  column_axes = tuple(a for a in plan.mesh.axis_names if a in used) or None
  fused = jax.shard_map(_concat_local, mesh=plan.mesh, in_specs=(specs,), out_specs=P(None, column_axes),
                        check_vma=False)(list(weights))
  return FusedWeights(fused, local_shapes, column_axes, tuple((s[1], s[2]) for s in specs))


def project_fused(x: jax.Array, fused: FusedWeights) -> list[jax.Array]:
  """x [B, S, H] (laid out as (act_batch, act_q_seq, act_embed) under a plan) -> [B, S, N_i, D_i] per weight, in
  x.dtype, each sharded like its weight's (N, D) axes: one GEMM."""
  plan = current_plan()
  if plan is None or plan.is_trivial:
    return _split_local(project("bsh,hc->bsc", x, fused.weight), fused.local_shapes)
  x_spec = plan.spec((ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_EMBED), x.shape)
  if x_spec[2] is not None:
    raise ValueError(f"project_fused needs the hidden axis of x unsplit, got the layout {x_spec}")

  def local(x, w):
    return _split_local(project("bsh,hc->bsc", x, w), fused.local_shapes)

  out_specs = [P(x_spec[0], x_spec[1], n, d) for n, d in fused.out_axes]
  return jax.shard_map(local, mesh=plan.mesh, in_specs=(x_spec, P(None, fused.column_axes)), out_specs=out_specs,
                       check_vma=False)(x, fused.weight)


def fused_projection(x: jax.Array, weights: Sequence[jax.Array],
                     weight_axes: Sequence[Sequence[str | None]]) -> list[jax.Array]:
  """``[project("bsh,hnd->bsnd", x, w) for w in weights]`` as one GEMM (``fuse_weights`` then ``project_fused``).

  Args:
    x: [B, S, H] activations, laid out as (act_batch, act_q_seq, act_embed) under a plan.
    weights: [H, N_i, D_i] each, same H.
    weight_axes: the logical axes of each weight (as in ``make_param``), which give its per-device slice.

  Returns:
    [B, S, N_i, D_i] in x.dtype per weight, each sharded like its weight's (N, D) axes.

  Falls back to one GEMM per weight when a plan splits H (of the weights or of x).
  """
  plan = current_plan()
  x_split = plan is not None and not plan.is_trivial and plan.spec(
      (ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_EMBED), x.shape)[2] is not None
  fused = None if x_split else fuse_weights(weights, weight_axes)
  if fused is None:
    return [project("bsh,hnd->bsnd", x, w) for w in weights]
  return project_fused(x, fused)
