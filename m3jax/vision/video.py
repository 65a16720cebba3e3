"""Video preprocessing on the host (numpy + PIL; M3_SPEC §7.8): frame sampling at a target fps, per-frame
smart_resize + bicubic resize + CLIP normalisation, even-count padding (last frame repeated), patch rows
ordered t-major then spatial-merge-block order, grid rows split into chunks of at most
``segment_max_frames`` temporal patches (HF's ``video_grid_thw``), and per-temporal-patch timestamps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from m3jax.vision.grid import split_segments
from m3jax.vision.image import ImageError, SmartResizeVariant, normalize, patchify, resize_bicubic, smart_resize


@dataclasses.dataclass(frozen=True)
class VideoProcessorConfig:
  """Video preprocessing knobs; defaults are the released processor's (per-frame area 3136..602112)."""

  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  min_pixels: int = 4 * 28 * 28
  max_pixels: int = 768 * 28 * 28
  segment_max_frames: int | None = 4
  variant: SmartResizeVariant = "vllm"


@dataclasses.dataclass(frozen=True)
class Video:
  """Decoded frames uint8 [T, H, W, 3] plus where they came from (for the timestamp text).

  native_fps: frame rate of the source; frame_indices: source index of every frame in ``frames``. When both are
  set, the prompt carries "]<]{t:.1f} seconds[>[" before every temporal patch.
  """

  frames: np.ndarray
  native_fps: float | None = None
  frame_indices: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ProcessedVideo:
  """pixel_values float32 [gt * gh * gw, 1176]; grid_thw int64 [chunks, 3] (sum of t = gt);
  timestamps: seconds for each of the gt temporal patches, or None without metadata."""

  pixel_values: np.ndarray
  grid_thw: np.ndarray
  timestamps: tuple[float, ...] | None


def sample_frame_indices(total_frames: int, native_fps: float, fps: float = 1.0, max_duration: float = 300.0
                         ) -> list[int]:
  """Indices of the frames to keep when sampling at ``fps`` (vLLM's MiniMax M3 video loader).

  Frame 0 is kept; then, repeatedly, the first frame at or after ``prev_kept_ts + 1 / fps - 1e-4`` seconds
  (strictly after the previous kept frame). Only the first ``max_duration`` seconds are read.
  """
  if total_frames <= 0:
    return []
  if native_fps <= 0 or fps <= 0:
    return [0]
  limit = min(total_frames, max(1, math.ceil(max_duration * native_fps)))
  indices: list[int] = [0]
  while True:
    target = max(math.ceil((indices[-1] / native_fps + 1.0 / fps - 1e-4) * native_fps), indices[-1] + 1)
    if target >= limit:
      return indices
    indices.append(target)


def video_timestamps(frame_indices: Sequence[int], native_fps: float, grid_t: int, temporal_patch_size: int = 2
                     ) -> tuple[float, ...]:
  """Seconds of every temporal patch f: frame_indices[min(f * tps, len - 1)] / native_fps."""
  n = len(frame_indices)
  return tuple(frame_indices[min(f * temporal_patch_size, n - 1)] / native_fps for f in range(grid_t))


def check_frames(frames: np.ndarray, name: str = "video") -> np.ndarray:
  """Validates frames uint8 [T, H, W, 3] (gray [T, H, W] / [T, H, W, 1] is replicated to RGB)."""
  frames = np.asarray(frames)
  if frames.dtype != np.uint8 or frames.ndim not in (3, 4) or frames.shape[0] < 1:
    raise ImageError(f"{name}: expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
  if frames.ndim == 3:
    frames = frames[..., None]
  if frames.shape[-1] == 1:
    frames = np.repeat(frames, 3, axis=-1)
  if frames.shape[-1] != 3:
    raise ImageError(f"{name}: frames need 3 channels (RGB), got {frames.shape[-1]}")
  return frames


def preprocess_video(video: Video | np.ndarray, cfg: VideoProcessorConfig = VideoProcessorConfig(), *,
                     name: str = "video") -> ProcessedVideo:
  """Frames -> HF-format patch rows, grid rows (chunked) and timestamps."""
  if not isinstance(video, Video):
    video = Video(np.asarray(video))
  frames = check_frames(video.frames, name)
  t, h, w, _ = frames.shape
  try:
    rh, rw = smart_resize(h, w, factor=cfg.patch_size * cfg.merge_size, min_pixels=cfg.min_pixels,
                          max_pixels=cfg.max_pixels, variant=cfg.variant)
  except ImageError as e:
    raise ImageError(f"{name}: {e}") from None
  resized = np.stack([resize_bicubic(f, rh, rw) for f in frames])
  pad = -t % cfg.temporal_patch_size
  if pad:
    resized = np.concatenate([resized, np.repeat(resized[-1:], pad, axis=0)])
  rows, (gt, gh, gw) = patchify(normalize(resized), patch_size=cfg.patch_size, merge_size=cfg.merge_size,
                                temporal_patch_size=cfg.temporal_patch_size)
  grid = np.asarray(split_segments([[gt, gh, gw]], cfg.segment_max_frames), np.int64)
  stamps = None
  if video.native_fps is not None and video.frame_indices is not None:
    if len(video.frame_indices) != t:
      raise ValueError(f"{name}: {len(video.frame_indices)} frame_indices for {t} frames")
    stamps = video_timestamps(video.frame_indices, video.native_fps, gt, cfg.temporal_patch_size)
  return ProcessedVideo(rows, grid, stamps)
