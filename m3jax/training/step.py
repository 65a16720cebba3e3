"""The training objective and the jit-compiled train / eval steps.

objective = lm_loss + mtp_weight * mtp_loss + indexer_weight * indexer_alignment_loss, over one batch of packed
rows. Two phases (indexer_loss.py): in the dense warm-up the sparse layers attend densely and the indexer learns
from every visible block; in the sparse phase they attend to the indexer's top-k and the alignment loss is
restricted to the selected blocks. After the optimizer update, every MoE layer's correction bias takes one
balancing step (router_balance.py) from the expert loads the forward pass recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from m3jax.research import Collect
from m3jax.training.optimizer import OptimizerConfig, make_optimizer, schedule
from m3jax.training.indexer_loss import alignment_loss_of_records
from m3jax.training.losses import lm_loss_from_logits, mtp_loss_from_trunk
from m3jax.training.params import ParamLayout, Params, model_of
from m3jax.training.router_balance import balanced_bias, expert_load, max_load_ratio

BIAS_SUFFIX = "mlp/correction_bias"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
  """Loss weights and the router balancing rate."""

  mtp_weight: float = 0.3
  indexer_weight: float = 1.0
  router_bias_rate: float = 1e-3


def _moe_bias_keys(layout: ParamLayout) -> list[str]:
  """Correction-bias keys in the order the forward records MoE layers: the trunk's, then the MTP modules'."""
  text = layout.config.text
  keys = [f"layers/{i}/{BIAS_SUFFIX}" for i, kind in enumerate(text.mlp_types) if kind == "moe"]
  if layout.with_mtp:
    keys += [f"mtp/{j}/layer/{BIAS_SUFFIX}" for j in range(text.num_mtp_modules)][:1]  # the loss runs module 0
  missing = [k for k in keys if k not in layout.keys]
  if missing:
    raise ValueError(f"internal: no parameter {missing[0]!r}")
  return keys


def objective(layout: ParamLayout, cfg: ObjectiveConfig, master: Params, rows: jax.Array, sparse: bool
              ) -> tuple[jax.Array, dict[str, Any]]:
  """(total loss, metrics) of rows int32 [B, S] (every row starts at position 0)."""
  model = model_of(layout, master)
  collect = Collect(indexer_alignment=cfg.indexer_weight > 0, routing=True, block_ids=sparse)
  out = model.forward(rows, collect=collect, dense_attention=not sparse)
  lm = lm_loss_from_logits(out.logits, rows)
  records = list(out.intermediates)
  total, metrics = lm, {"lm_loss": lm}
  if layout.with_mtp:
    mtp, mtp_out = mtp_loss_from_trunk(model, rows, out.hidden, collect=collect, dense_attention=not sparse)
    records += list(mtp_out.intermediates)
    total = total + cfg.mtp_weight * mtp
    metrics["mtp_loss"] = mtp
  if cfg.indexer_weight > 0:
    idx, _ = alignment_loss_of_records(records, sparse)
    total = total + cfg.indexer_weight * idx
    metrics["indexer_loss"] = idx
  num_experts = layout.config.text.num_experts
  loads = [expert_load(r["expert_ids"], num_experts) for r in records if "expert_ids" in r]
  metrics["expert_load"] = jnp.stack(loads) if loads else jnp.zeros((0, num_experts))
  metrics["loss"] = total
  return total, metrics


def init_state(layout: ParamLayout, tx: optax.GradientTransformation, master: Params) -> dict[str, Any]:
  """{"params": master, "opt_state": tx's, "step": 0}; under a plan, every leaf the parameters' layout does not
  place (optimizer counters, the step) is replicated over the mesh, so that one jit program takes them all."""
  state = {"params": master, "opt_state": jax.jit(tx.init)(master), "step": jnp.zeros((), jnp.int32)}
  if layout.plan is None or layout.plan.is_trivial:
    return state
  mesh = layout.plan.mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(x):
    on_mesh = isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
    return x if on_mesh else jax.device_put(x, replicated)

  return jax.tree.map(place, state)


def make_train_step(layout: ParamLayout, optimizer: OptimizerConfig, cfg: ObjectiveConfig, *, sparse: bool,
                    state_shardings: Any = None
                    ) -> Callable[[dict[str, Any], jax.Array], tuple[dict[str, Any], dict[str, Any]]]:
  """A ``(state, rows) -> (state, metrics)`` for one phase; state = {"params", "opt_state", "step"}, its
  optimizer state from ``make_optimizer(optimizer)``. The schedule's learning rate at ``state["step"]`` is
  evaluated outside the compiled step and passed in as data, so the program does not depend on the schedule
  (a fine-tune with other rates and step counts reuses the pretraining's program). The state's buffers are
  donated; ``state_shardings`` keeps the state's layout from step to step."""
  bias_keys = _moe_bias_keys(layout)
  rate_at = jax.jit(schedule(optimizer))  # compiled like the rate it replaces inside the step: the same bits

  def step(state, rows, learning_rate):
    tx = make_optimizer(optimizer, learning_rate)
    grad_fn = jax.value_and_grad(lambda p: objective(layout, cfg, p, rows, sparse), has_aux=True)
    (_, metrics), grads = grad_fn(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    loads = metrics["expert_load"]
    if len(bias_keys) != loads.shape[0]:
      raise ValueError(f"internal: {len(bias_keys)} correction biases for {loads.shape[0]} recorded MoE layers")
    for i, key in enumerate(bias_keys):
      params[key] = balanced_bias(params[key], loads[i], cfg.router_bias_rate)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=learning_rate,
                   max_load_ratio=max_load_ratio(loads) if loads.shape[0] else jnp.zeros(()))
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  shardings = None if state_shardings is None else (state_shardings, None)
  compiled = jax.jit(step, donate_argnums=(0,), out_shardings=shardings)

  def train_step(state, rows):
    return compiled(state, rows, rate_at(state["step"]).astype(jnp.float32))
  return train_step


def make_eval_step(layout: ParamLayout) -> Callable[[Params, jax.Array], dict[str, jax.Array]]:
  """A jit-compiled ``(params, rows) -> {"lm_loss", "mtp_loss"?}`` of the model as it runs after training
  (sparse attention), without gradients."""

  def evaluate(master, rows):
    model = model_of(layout, master)
    out = model.forward(rows)
    metrics = {"lm_loss": lm_loss_from_logits(out.logits, rows)}
    if layout.with_mtp:
      metrics["mtp_loss"] = mtp_loss_from_trunk(model, rows, out.hidden)[0]
    return metrics

  return jax.jit(evaluate)
