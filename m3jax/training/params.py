"""The trainable parameters as a flat dict of fp32 master arrays, and the model they make in the compute dtype.

``ParamLayout`` is built once from the config: the compute model's graph (kernels='reference', the sharding plan
attached) and, per parameter, its key ("layers/3/mlp/w_gate_up"), its compute dtype (the router and correction
bias stay fp32 in a bf16 model) and its logical axes. ``init_master`` draws an fp32 model's initial weights;
``model_of`` rebuilds the model from the master dict inside a traced function (cast to the compute dtype, so
gradients come back to the fp32 masters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import sharding
from m3jax.config import M3Config
from m3jax.model import M3ForCausalLM

Params = dict[str, jax.Array]


def key_of(path: tuple[Any, ...]) -> str:
  return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """The compute model's graph and its parameter slots (path, key, Variable carrying dtype + logical axes)."""

  graphdef: Any
  slots: tuple[tuple[tuple[Any, ...], str, nnx.Variable], ...]
  config: M3Config
  with_mtp: bool
  plan: sharding.ShardingPlan | None

  @property
  def keys(self) -> tuple[str, ...]:
    return tuple(key for _, key, _ in self.slots)

  def sharding(self, key: str) -> jax.sharding.Sharding | None:
    """Where a master parameter lives: its logical axes under the plan (None without a plan)."""
    if self.plan is None:
      return None
    var = dict((k, v) for _, k, v in self.slots)[key]
    return self.plan.sharding(sharding.logical_axes_of(var), var.get_value().shape)


def make_layout(config: M3Config, compute_dtype: Any, *, with_mtp: bool,
                plan: sharding.ShardingPlan | None = None) -> ParamLayout:
  """The compute model (text only, reference ops) described without allocating it."""
  text_only = dataclasses.replace(config, vision=None)
  abstract = nnx.eval_shape(lambda: M3ForCausalLM(text_only, dtype=compute_dtype, kernels="reference",
                                                  rngs=nnx.Rngs(0), with_mtp=with_mtp))
  abstract.sharding_plan = plan
  graphdef, state = nnx.split(abstract, nnx.Param)
  slots = tuple((path, key_of(path), var) for path, var in nnx.to_flat_state(state))
  return ParamLayout(graphdef=graphdef, slots=slots, config=text_only, with_mtp=with_mtp, plan=plan)


def init_master(layout: ParamLayout, seed: int) -> Params:
  """Freshly initialised fp32 master weights (M3ForCausalLM's initialisers, seeded), placed by the plan."""
  model = M3ForCausalLM(layout.config, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(seed),
                        with_mtp=layout.with_mtp)
  flat = {key_of(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  if set(flat) != set(layout.keys):
    raise ValueError(f"internal: fp32 and compute models differ in parameters: {sorted(set(flat) ^ set(layout.keys))[:3]}")
  out = {}
  for key in layout.keys:
    value = flat[key].astype(jnp.float32)
    target = layout.sharding(key)
    out[key] = value if target is None else jax.device_put(value, target)
  return out


def model_of(layout: ParamLayout, master: Params) -> M3ForCausalLM:
  """The compute-dtype model over the master weights (call inside a traced function: the cast is differentiable)."""
  flat = [(path, var.replace(master[key].astype(var.get_value().dtype))) for path, key, var in layout.slots]
  return nnx.merge(layout.graphdef, nnx.from_flat_state(flat))


def count_params(master: Params) -> int:
  return sum(int(v.size) for v in master.values())
