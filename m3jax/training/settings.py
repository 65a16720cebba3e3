"""What a training run is asked to do (``TrainConfig``) and the checks it passes before any step runs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from m3jax import sharding
from m3jax.config import M3Config
from m3jax.model import model_dtype

# Settings a resumed run may change without changing the loss curve.
RESUME_FREE = ("progress", "mesh", "checkpoint_every", "eval_every", "eval_batches", "time_limit_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """A training run. Defaults suit a small model on one GPU; ``m3jax train --help`` documents each."""

  steps: int = 1000
  batch: int = 16
  seq_len: int = 512
  learning_rate: float = 2e-3
  warmup_steps: int | None = None  # None: min(100, steps // 10)
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  mtp_weight: float = 0.3
  indexer_weight: float = 1.0
  indexer_warmup_steps: int | None = None  # None: steps // 5 (dense warm-up phase of the indexer)
  router_bias_rate: float = 1e-3
  eval_every: int = 100
  eval_batches: int = 4
  checkpoint_every: int = 100
  seed: int = 0
  holdout_fraction: float = 0.02
  compute_dtype: str = "bfloat16"
  save_dtype: str = "bfloat16"
  init_from: str | None = None  # fine-tune: start from this m3jax checkpoint (its config and tokenizer)
  mesh: str | None = None
  progress: bool = True
  # Stop at the first step boundary after this many seconds of the step loop, then checkpoint, evaluate and
  # export the model of the step reached (a rerun of the same settings resumes from it toward ``steps``).
  time_limit_s: float | None = None

  @property
  def warmup(self) -> int:
    return min(100, self.steps // 10) if self.warmup_steps is None else self.warmup_steps

  @property
  def indexer_warmup(self) -> int:
    return self.steps // 5 if self.indexer_warmup_steps is None else self.indexer_warmup_steps

  def resume_key(self) -> dict[str, Any]:
    """The settings that must match for a resumed run to continue the same loss curve."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in RESUME_FREE}


class TrainSetupError(ValueError):
  """Settings, config or mesh that cannot train (raised before any step runs)."""


def check_setup(cfg: M3Config, tc: TrainConfig) -> None:
  """Raises TrainSetupError naming the first setting that cannot train this config."""
  t = cfg.text
  if tc.time_limit_s is not None and not tc.time_limit_s > 0:
    raise TrainSetupError(f"time limit must be a positive number of seconds, got {tc.time_limit_s}")
  for name in ("steps", "batch", "eval_every", "eval_batches", "checkpoint_every"):
    if getattr(tc, name) < 1:
      raise TrainSetupError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(tc, name)}")
  for name in ("compute_dtype", "save_dtype"):
    try:
      model_dtype(getattr(tc, name))
    except ValueError as e:
      raise TrainSetupError(f"--{name.replace('_', '-')}: {e}") from None
  if not 0 <= tc.warmup < tc.steps:
    raise TrainSetupError(f"warm-up steps {tc.warmup} must be in [0, steps={tc.steps})")
  if not 0 <= tc.indexer_warmup <= tc.steps:
    raise TrainSetupError(f"indexer warm-up steps {tc.indexer_warmup} must be in [0, steps={tc.steps}]")
  min_len = 3 if t.num_mtp_modules else 2
  if tc.seq_len < min_len:
    raise TrainSetupError(f"--seq-len {tc.seq_len} is too short: next-token{' and MTP' if min_len == 3 else ''} "
                          f"targets need at least {min_len} tokens")
  if tc.seq_len > t.max_position_embeddings:
    raise TrainSetupError(f"--seq-len {tc.seq_len} exceeds the config's max_position_embeddings "
                          f"{t.max_position_embeddings}")
  if t.num_mtp_modules and tc.mtp_weight <= 0:
    raise TrainSetupError(f"the config has {t.num_mtp_modules} MTP module(s) but the MTP loss weight is "
                          f"{tc.mtp_weight}: they would be exported untrained (set num_mtp_modules to 0 instead)")
  if t.num_sparse_layers or t.num_mtp_modules:  # the MTP layer is sparse whatever the layouts say
    blocks = math.ceil(tc.seq_len / t.index_block_size)
    if t.index_topk_blocks >= blocks:
      raise TrainSetupError(
          f"index_topk_blocks {t.index_topk_blocks} >= the {blocks} key blocks of a {tc.seq_len}-token row "
          f"(index_block_size {t.index_block_size}): the selection would keep every block, so the sparse layers "
          "and their indexers would never be trained as sparse; raise --seq-len or lower the top-k / block size")
  if tc.mesh is not None:
    try:
      sizes = sharding.parse_mesh(tc.mesh)
      sharding.check_config(cfg, sizes)
    except ValueError as e:
      raise TrainSetupError(f"--mesh {tc.mesh}: {e}") from None
    batch_ways = sizes["data"] * sizes["expert"]
    if tc.batch % batch_ways:
      raise TrainSetupError(f"--batch {tc.batch} is not divisible by the mesh's data x expert = {batch_ways} "
                            "batch shards")
