"""Training M3-architecture models: losses, router balancing, the trainer (``m3jax train``).

  lm_loss(model, input_ids, loss_mask=None)   mean next-token cross-entropy (HF's labels=input_ids)
  mtp_loss(model, input_ids, loss_mask=None)  the first MTP module's token-after-next cross-entropy
  indexer_alignment_loss(target, scores, selected=None)   KL of the indexer to dense attention's block mass
  train(config, corpus, out, TrainConfig(...))             the whole run; see m3jax.training.trainer
"""

from m3jax.training.indexer_loss import indexer_alignment_loss
from m3jax.training.losses import lm_loss, mtp_loss, reference_view
from m3jax.training.settings import TrainConfig, TrainSetupError
from m3jax.training.trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "TrainSetupError", "indexer_alignment_loss", "lm_loss", "mtp_loss",
           "reference_view", "train"]
