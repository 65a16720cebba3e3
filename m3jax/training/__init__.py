"""Training M3-architecture models: losses, router balancing, the trainer (``m3jax train``)."""

from m3jax.training.indexer_loss import indexer_alignment_loss
from m3jax.training.losses import lm_loss, mtp_loss, reference_view

__all__ = ["indexer_alignment_loss", "lm_loss", "mtp_loss", "reference_view"]
