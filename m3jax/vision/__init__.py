"""MiniMax M3 vision path: tower + projector (NNX), packed segment layout, feature scatter, and host-side
preprocessing (images, videos, prompt expansion) in numpy / PIL.

For generation with images: ``inputs = build_multimodal_inputs(prompt, tokenizer, images=[...])`` then
``model.embed_multimodal(inputs.input_ids, **inputs.pixel_kwargs())`` gives the prefill ``inputs_embeds``.
"""

from m3jax.vision.embed import (VisionBatch, check_placeholders, multimodal_embeddings, scatter_features,
                                vision_batch, vision_features, vision_tower_states)
from m3jax.vision.encoder import VisionModel
from m3jax.vision.grid import VisionLayout, split_segments, vision_layout
from m3jax.vision.image import (ImageError, ImageProcessorConfig, load_image, num_image_tokens, preprocess_images,
                                smart_resize)
from m3jax.vision.prompt import (IMAGE_MARKER, VIDEO_MARKER, VISION_END, VISION_START, MultimodalInputs,
                                 build_multimodal_inputs, expand_prompt)
from m3jax.vision.video import (Video, VideoProcessorConfig, preprocess_video, sample_frame_indices,
                                video_timestamps)

__all__ = [
    "IMAGE_MARKER", "ImageError", "ImageProcessorConfig", "MultimodalInputs", "VIDEO_MARKER", "VISION_END",
    "VISION_START", "Video", "VideoProcessorConfig", "VisionBatch", "VisionLayout", "VisionModel",
    "build_multimodal_inputs", "check_placeholders", "expand_prompt", "load_image", "multimodal_embeddings",
    "num_image_tokens", "preprocess_images", "preprocess_video", "sample_frame_indices", "scatter_features",
    "smart_resize", "split_segments", "video_timestamps", "vision_batch", "vision_features", "vision_layout",
    "vision_tower_states",
]
