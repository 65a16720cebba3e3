"""MiniMax M3 vision path: tower + projector (NNX), packed segment layout, feature scatter, and host-side
preprocessing (images, videos, prompt expansion) in numpy / PIL."""

from m3jax.vision.embed import (VisionBatch, check_placeholders, multimodal_embeddings, scatter_features,
                                vision_batch, vision_features, vision_tower_states)
from m3jax.vision.encoder import VisionModel
from m3jax.vision.grid import VisionLayout, split_segments, vision_layout

__all__ = ["VisionBatch", "VisionLayout", "VisionModel", "check_placeholders", "multimodal_embeddings",
           "scatter_features", "split_segments", "vision_batch", "vision_features", "vision_layout",
           "vision_tower_states"]
