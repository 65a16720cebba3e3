"""The optimizer: optax AdamW on fp32 master weights, linear warm-up then cosine decay, global-norm clipping.

Parameters are a flat dict {"layers/3/mlp/w_gate_up": fp32 array}. Weight decay applies to matrices only (not
to norms or the router's correction bias); the correction biases get no optimizer update at all: they are moved
by the router balancing rule instead (router_balance.py).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

BIAS_SUFFIX = "correction_bias"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """Peak learning rate, warm-up steps, total steps, cosine floor (fraction of the peak), AdamW's betas / eps /
  weight decay, and the global gradient-norm clip."""

  learning_rate: float = 2e-3
  warmup_steps: int = 100
  total_steps: int = 1000
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0 or self.total_steps < 1 or not 0 <= self.warmup_steps < self.total_steps:
      raise ValueError(f"optimizer: need learning_rate > 0, steps >= 1 and 0 <= warm-up < steps; got lr "
                       f"{self.learning_rate}, warm-up {self.warmup_steps}, steps {self.total_steps}")
    if not 0 <= self.min_lr_ratio <= 1 or self.clip_norm <= 0:
      raise ValueError(f"optimizer: need 0 <= min_lr_ratio <= 1 and clip_norm > 0; got {self.min_lr_ratio}, "
                       f"{self.clip_norm}")


def schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then cosine to peak * min_lr_ratio at total_steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _trainable(params: dict[str, jax.Array]) -> dict[str, bool]:
  return {k: not k.endswith(BIAS_SUFFIX) for k in params}


def _decayed(params: dict[str, jax.Array]) -> dict[str, bool]:
  return {k: getattr(v, "ndim", 0) >= 2 and not k.endswith(BIAS_SUFFIX) for k, v in params.items()}


def make_optimizer(cfg: OptimizerConfig, learning_rate: jax.Array | None = None) -> optax.GradientTransformation:
  """clip -> AdamW (decay on matrices) for every parameter but the correction biases, which stay untouched.

  ``learning_rate``: the rate of this update (an fp32 scalar, traced inside the train step, so that one compiled
  step serves every schedule: a fine-tune reuses the pretraining's program); None: ``schedule(cfg)`` at the
  optimizer's step count. Either way the optimizer state has the same structure (AdamW's moments and the
  schedule's count), so states and checkpoints are interchangeable."""
  rate = schedule(cfg) if learning_rate is None else (lambda count: learning_rate)
  adamw = optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decayed))
  return optax.multi_transform({True: adamw, False: optax.set_to_zero()}, _trainable)
