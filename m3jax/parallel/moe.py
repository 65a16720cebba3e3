"""Expert-parallel MoE block under ``shard_map``: gather / scatter token dispatch.

Routed experts are split over the mesh axes of the ``experts`` rule (``expert x tensor``): each device holds
E / N whole experts. Per device:

  1. all-gather the tokens of the devices that share its token set but hold other experts (the token axes
     that are also expert axes; nothing to gather when tokens are replicated, e.g. decode);
  2. route every gathered token (fp32 router, replicated weights: the same choice on every device);
  3. run only the assignments that hit a local expert (``routed_experts``: the Pallas Mosaic GPU grouped
     GEMMs on GPU, ``routed_experts_reference``'s sorted ``ragged_dot`` otherwise, by the kernel choice;
     assignments to other devices' experts are dropped before the GEMMs and contribute exact zeros);
  4. reduce-scatter the fp32 partial sums back to the token shards (psum over expert axes that did not
     gather).

The shared expert runs outside shard_map as a tensor-parallel dense MLP. Why gather/scatter and not
``ragged_all_to_all``: XLA:CPU does not implement ragged-all-to-all (UNIMPLEMENTED), so that dispatch could
not be tested here; see docs/sharding.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax import logical_axes as ax
from m3jax.sharding import ShardingPlan, constrain, spec_axes
from m3jax.ops.dispatch import KernelChoice, run_op
from pallas_kernels.moe.api import ExpertOperands, prepare_expert_weights
from pallas_kernels.moe.reference import gated_mlp, route_reference, routed_experts_reference


def _expert_spec(plan: ShardingPlan) -> P:
  """Routed expert weights per device: whole experts, split over the ``experts`` rule's mesh axes."""
  return P(spec_axes(plan.spec((ax.EXPERTS,))[0]) or None, None, None)


def prepare_routed(plan: ShardingPlan, w_gate_up: jax.Array, w_down: jax.Array) -> ExpertOperands:
  """fp32 routed expert weights -> the kernels' split operands (``prepare_expert_weights``), built per device
  in ``moe_block``'s expert layout, for its ``prepared``. Only the routed experts: the shared expert runs as a
  dense MLP outside the kernels here."""
  spec = _expert_spec(plan)
  return jax.shard_map(lambda gu, d: prepare_expert_weights(jnp.float32, gu, d), mesh=plan.mesh,
                       in_specs=(spec, spec), out_specs=ExpertOperands(spec, spec), check_vma=False)(w_gate_up, w_down)


def moe_block(plan: ShardingPlan, x: jax.Array, router_w: jax.Array, correction_bias: jax.Array,
              w_gate_up: jax.Array, w_down: jax.Array, shared_gate_up: jax.Array, shared_down: jax.Array, *,
              top_k: int, routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float,
              kernels: KernelChoice = "reference", prepared: ExpertOperands | None = None) -> jax.Array:
  """The M3 MoE block (moe_block_reference's contract) with expert parallelism.

  Args:
    plan: the active sharding plan (multi-device).
    x: [B, S, H] (token sharding from the act_batch / act_seq rules).
    other weights: as pallas_kernels.moe.reference (w_gate_up [E, H, 2I], w_down [E, I, H]).
    kernels: the kernel choice for the per-device routed experts (m3jax.ops.dispatch).
    prepared: optional ``prepare_routed(plan, w_gate_up, w_down)``, built once for many calls.

  Returns:
    [B, S, H] in x.dtype.
  """
  b, s, h = x.shape
  num_experts = router_w.shape[1]
  tok = plan.spec((ax.ACT_BATCH, ax.ACT_SEQ), (b, s))
  token_axes = spec_axes(tok[0]) + spec_axes(tok[1])
  expert_axes = spec_axes(plan.spec((ax.EXPERTS,))[0])
  if num_experts % max(1, plan.axis_product(ax.EXPERTS)):
    raise ValueError(f"{num_experts} experts do not split over {expert_axes}")
  x = constrain(x, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
  flat = x.reshape(b * s, h)
  gather = tuple(a for a in token_axes if a in expert_axes)
  reduce = tuple(a for a in expert_axes if a not in gather)

  def per_device(x_l, router_l, bias_l, wgu_l, wd_l, prepared_l):
    xg = jax.lax.all_gather(x_l, gather, axis=0, tiled=True) if gather else x_l
    weights, ids, _ = route_reference(xg, router_l, bias_l, top_k=top_k)
    first = (jax.lax.axis_index(expert_axes) if expert_axes else 0) * wgu_l.shape[0]
    y = run_op(kernels, kernel_module="pallas_kernels.moe", kernel_name="routed_experts",
               reference=routed_experts_reference,
               args=(xg, weights, ids, wgu_l, wd_l, jnp.asarray(first, jnp.int32)),
               kwargs=dict(alpha=swiglu_alpha, limit=swiglu_limit),
               kernel_kwargs=None if prepared_l is None else dict(prepared=ExpertOperands(*prepared_l)))
    if gather:
      y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
    if reduce:
      y = jax.lax.psum(y, reduce)
    return y

  tok_spec = P(token_axes or None, None)
  w_spec = _expert_spec(plan)
  # Per leaf: a quantized weight's values / scales [E, out, in'] and an nvfp4 global scale [E, P] split alike.
  leaf_specs = lambda w: jax.tree.map(lambda a: P(w_spec[0], *(None,) * (a.ndim - 1)), w)
  if prepared is not None and (prepared.shared_gate_up is not None or prepared.shared_down is not None):
    raise ValueError("expert-parallel moe_block takes routed operands only (prepare_routed), got shared ones too")
  operands = None if prepared is None else (prepared.gate_up, prepared.down)
  operand_specs = None if prepared is None else (w_spec, w_spec)
  routed = jax.shard_map(per_device, mesh=plan.mesh,
                         in_specs=(tok_spec, P(), P(), leaf_specs(w_gate_up), leaf_specs(w_down), operand_specs),
                         out_specs=tok_spec, check_vma=False)(flat, router_w, correction_bias, w_gate_up, w_down,
                                                              operands)
  shared = gated_mlp(flat, shared_gate_up, shared_down, alpha=swiglu_alpha, limit=swiglu_limit)
  y = (routed * routed_scaling_factor + shared.astype(jnp.float32)).astype(x.dtype)
  return y.reshape(b, s, h)
