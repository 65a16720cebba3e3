"""Host-side entry points of the vision path: validate inputs, build the packed layout, run the tower
(jit-compiled per layout shape) and scatter features into the text embeddings (M3_SPEC §7.6).

Inputs use HF's flattened patch format: ``pixel_values`` [N_img_rows, C*T*P*P] with ``image_grid_thw`` int
[num_images, 3], and ``pixel_values_videos`` / ``video_grid_thw`` likewise; grids must be concrete (numpy or
host arrays), since they fix the shapes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.config import M3Config
from m3jax.vision.grid import VisionLayout, check_grid, vision_layout
from m3jax.vision.tower import patch_dim

if TYPE_CHECKING:
  from m3jax.model import M3ForCausalLM
  from m3jax.vision.encoder import VisionModel


@dataclasses.dataclass(frozen=True)
class VisionBatch:
  """Image rows followed by video rows, their packed layout, and how many merged tokens each modality has."""

  pixel_values: jax.Array
  layout: VisionLayout
  num_image_tokens: int
  num_video_tokens: int

  def layout_arrays(self) -> tuple[jax.Array, ...]:
    """(positions, pack_index, pack_valid, unpack_index) as device arrays."""
    lay = self.layout
    return (jnp.asarray(lay.positions), jnp.asarray(lay.pack_index), jnp.asarray(lay.pack_valid),
            jnp.asarray(lay.unpack_index))


def _rows(config: M3Config, name: str, pixels, grid_name: str, grid) -> tuple[jax.Array | None, np.ndarray]:
  v = config.vision
  if pixels is None and grid is None:
    return None, np.zeros((0, 3), np.int64)
  if pixels is None or grid is None:
    raise ValueError(f"{name} and {grid_name} must be given together")
  grid = check_grid(grid, v.spatial_merge_size)
  pixels = jnp.asarray(pixels)
  want = int(np.prod(grid, axis=1).sum())
  if pixels.ndim != 2 or pixels.shape != (want, patch_dim(v)):
    raise ValueError(f"{name} has shape {tuple(pixels.shape)}, but {grid_name} {grid.tolist()} needs "
                     f"[{want}, {patch_dim(v)}] (sum of t*h*w rows of C*T*P*P values)")
  if not jnp.issubdtype(pixels.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got {pixels.dtype}")
  return pixels, grid


def vision_batch(config: M3Config, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                 video_grid_thw=None) -> VisionBatch:
  """Validates and concatenates image and video rows (images first) into one packed batch."""
  if config.vision is None:
    raise ValueError("this model has no vision tower (no vision_config, or loaded with text_only=True)")
  img, img_grid = _rows(config, "pixel_values", pixel_values, "image_grid_thw", image_grid_thw)
  vid, vid_grid = _rows(config, "pixel_values_videos", pixel_values_videos, "video_grid_thw", video_grid_thw)
  parts = [p for p in (img, vid) if p is not None]
  if not parts:
    raise ValueError("no pixel_values / pixel_values_videos given")
  v = config.vision
  layout = vision_layout(np.concatenate([img_grid, vid_grid]), merge=v.spatial_merge_size,
                         max_frames=v.segment_max_frames)
  merge2 = v.spatial_merge_size ** 2
  n_img = int(np.prod(img_grid, axis=1).sum()) // merge2
  n_vid = int(np.prod(vid_grid, axis=1).sum()) // merge2
  pixels = parts[0] if len(parts) == 1 else jnp.concatenate([p.astype(jnp.float32) for p in parts])
  return VisionBatch(pixels, layout, n_img, n_vid)


def check_placeholders(input_ids, config: M3Config, num_image_tokens: int, num_video_tokens: int) -> None:
  """Raises ValueError unless input_ids holds exactly one placeholder per image / video feature."""
  ids = np.asarray(input_ids)
  for kind, token, n in (("image", config.image_token_id, num_image_tokens),
                         ("video", config.video_token_id, num_video_tokens)):
    have = int(np.sum(ids == token))
    if have != n:
      raise ValueError(f"input_ids has {have} {kind} placeholder tokens (id {token}) but the {kind} inputs give "
                       f"{n} features (sum of t*h*w/merge^2 over the {kind} grid); expand every {kind} marker "
                       "with m3jax.vision.build_multimodal_inputs")


def scatter_features(embeds: jax.Array, input_ids: jax.Array, token_id: int, features: jax.Array) -> jax.Array:
  """embeds [B, S, H] with the positions where input_ids == token_id replaced, in row-major order, by
  features [K, H] (K = number of such positions; checked by the caller)."""
  if features.shape[0] == 0:
    return embeds
  mask = (input_ids == token_id).reshape(-1)
  order = jnp.clip(jnp.cumsum(mask.astype(jnp.int32)) - 1, 0, features.shape[0] - 1)
  gathered = features.astype(embeds.dtype)[order].reshape(embeds.shape)
  return jnp.where(mask.reshape(input_ids.shape)[..., None], gathered, embeds)


def _embed_traced(model: "M3ForCausalLM", input_ids, pixels, positions, pack_index, pack_valid, unpack_index,
                  n_image_tokens: int) -> jax.Array:
  feats = model.vision(pixels, positions, pack_index, pack_valid, unpack_index)
  embeds = model.embed_tokens(input_ids)
  embeds = scatter_features(embeds, input_ids, model.config.image_token_id, feats[:n_image_tokens])
  return scatter_features(embeds, input_ids, model.config.video_token_id, feats[n_image_tokens:])


@nnx.jit(static_argnames=("n_image_tokens",))
def _jit_embeds(model, input_ids, pixels, positions, pack_index, pack_valid, unpack_index, n_image_tokens):
  return _embed_traced(model, input_ids, pixels, positions, pack_index, pack_valid, unpack_index, n_image_tokens)


@nnx.jit(static_argnames=("n_image_tokens",))
def _jit_logits(model, input_ids, pixels, positions, pack_index, pack_valid, unpack_index, n_image_tokens):
  embeds = _embed_traced(model, input_ids, pixels, positions, pack_index, pack_valid, unpack_index,
                         n_image_tokens)
  return model.forward(input_ids, inputs_embeds=embeds).logits


def _prepare(model: "M3ForCausalLM", input_ids, kwargs) -> tuple[jax.Array, VisionBatch]:
  if getattr(model, "vision", None) is None:
    raise ValueError("pixel inputs given, but this model has no vision tower (config without vision_config, "
                     "or loaded with text_only=True)")
  batch = vision_batch(model.config, **kwargs)
  check_placeholders(input_ids, model.config, batch.num_image_tokens, batch.num_video_tokens)
  return jnp.asarray(input_ids).astype(jnp.int32), batch


def multimodal_embeddings(model: "M3ForCausalLM", input_ids, **pixel_kwargs) -> jax.Array:
  """input_ids [B, S] + pixel inputs -> inputs_embeds [B, S, H] (for ``model.forward(inputs_embeds=...)``)."""
  ids, batch = _prepare(model, input_ids, pixel_kwargs)
  return _jit_embeds(model, ids, batch.pixel_values, *batch.layout_arrays(), n_image_tokens=batch.num_image_tokens)


def multimodal_logits(model: "M3ForCausalLM", input_ids, **pixel_kwargs) -> jax.Array:
  """input_ids [B, S] + pixel inputs -> fp32 logits [B, S, V] (one jit)."""
  ids, batch = _prepare(model, input_ids, pixel_kwargs)
  return _jit_logits(model, ids, batch.pixel_values, *batch.layout_arrays(), n_image_tokens=batch.num_image_tokens)


@nnx.jit
def _jit_tower(vision, pixels, positions, pack_index, pack_valid, unpack_index):
  return vision.tower(pixels, positions, pack_index, pack_valid, unpack_index)


@nnx.jit
def _jit_features(vision, pixels, positions, pack_index, pack_valid, unpack_index):
  return vision(pixels, positions, pack_index, pack_valid, unpack_index)


def vision_tower_states(vision: "VisionModel", pixel_values, grid_thw) -> jax.Array:
  """Last-layer tower hidden states [N, D] for pixel rows [N, C*T*P*P] and their grid_thw."""
  batch = vision_batch(vision.config, pixel_values, grid_thw)
  return _jit_tower(vision, batch.pixel_values, *batch.layout_arrays())


def vision_features(vision: "VisionModel", pixel_values, grid_thw) -> jax.Array:
  """Projected, merged features [N / merge^2, H] for pixel rows [N, C*T*P*P] and their grid_thw."""
  batch = vision_batch(vision.config, pixel_values, grid_thw)
  return _jit_features(vision, batch.pixel_values, *batch.layout_arrays())
