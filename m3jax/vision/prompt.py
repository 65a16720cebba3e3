"""Prompt expansion (M3_SPEC §7.9) and the one-call multimodal prompt builder used by generation.

An image marker ``]<]image[>[`` becomes START + N x IMAGE + END (N = gh * gw / merge^2). A video marker becomes,
for every temporal patch, the timestamp text ``]<]{t:.1f} seconds[>[`` (when the video has fps + frame indices)
followed by START + M x VIDEO + END (M = gh * gw / merge^2); videos reuse the *image* start / end markers.

Tokenisation matches HF's processor (which tokenises the expanded string) as long as the four marker strings
are added / special tokens of the tokenizer, which split the text: the text between two markers (timestamps
included) is encoded as one piece without special tokens, and the markers are inserted as ids.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from m3jax.vision.image import ImageLike, ImageProcessorConfig, image_rows, resized_image
from m3jax.vision.video import ProcessedVideo, Video, VideoProcessorConfig, preprocess_video

IMAGE_MARKER = "]<]image[>["
VIDEO_MARKER = "]<]video[>["
VISION_START = "]<]start of image[>["
VISION_END = "]<]end of image[>["
_MARKERS = re.compile(re.escape(IMAGE_MARKER) + "|" + re.escape(VIDEO_MARKER))


@dataclasses.dataclass(frozen=True)
class MultimodalInputs:
  """What ``model(...)`` / ``model.embed_multimodal(...)`` take: input_ids int32 [1, S] plus HF-format pixel
  inputs (None when the prompt has no image / video)."""

  input_ids: np.ndarray
  pixel_values: np.ndarray | None = None
  image_grid_thw: np.ndarray | None = None
  pixel_values_videos: np.ndarray | None = None
  video_grid_thw: np.ndarray | None = None

  def pixel_kwargs(self) -> dict[str, np.ndarray]:
    """The pixel keyword arguments that are set (for ``model(input_ids, **inputs.pixel_kwargs())``)."""
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def image_expansion(grid_thw: Sequence[int], merge_size: int = 2) -> str:
  """START + N x IMAGE + END for one image grid (t, gh, gw)."""
  n = int(np.prod(grid_thw)) // merge_size ** 2
  return VISION_START + IMAGE_MARKER * n + VISION_END


def video_expansion(grid_thw: np.ndarray, timestamps: Sequence[float] | None, merge_size: int = 2) -> str:
  """Per temporal patch: optional timestamp text, START + M x VIDEO + END; grid_thw [chunks, 3] of one video."""
  grid = np.asarray(grid_thw).reshape(-1, 3)
  grid_t, per_frame = int(grid[:, 0].sum()), int(grid[0, 1] * grid[0, 2]) // merge_size ** 2
  out = ""
  for f in range(grid_t):
    if timestamps is not None:
      out += f"]<]{timestamps[f]:.1f} seconds[>["
    out += VISION_START + VIDEO_MARKER * per_frame + VISION_END
  return out


def expand_prompt(prompt: str, image_grids: Sequence[Sequence[int]] = (), videos: Sequence[ProcessedVideo] = (),
                  merge_size: int = 2) -> str:
  """The prompt with every marker expanded (the string HF's processor tokenises)."""
  _check_marker_counts(prompt, len(image_grids), len(videos))
  it_img, it_vid = iter(image_grids), iter(videos)

  def repl(m: re.Match) -> str:
    if m.group(0) == IMAGE_MARKER:
      return image_expansion(next(it_img), merge_size)
    v = next(it_vid)
    return video_expansion(v.grid_thw, v.timestamps, merge_size)

  return _MARKERS.sub(repl, prompt)


def _check_marker_counts(prompt: str, n_images: int, n_videos: int) -> None:
  for kind, marker, n in (("image", IMAGE_MARKER, n_images), ("video", VIDEO_MARKER, n_videos)):
    have = prompt.count(marker)
    if have != n:
      raise ValueError(f"the prompt has {have} {kind} marker(s) '{marker}' but {n} {kind}(s) were given; put "
                       f"one marker where each {kind} goes")


class _Tokenizer:
  """Adapter over a ``tokenizers.Tokenizer`` or a transformers tokenizer (encode without special tokens)."""

  def __init__(self, tok: Any):
    self.tok = tok

  def encode(self, text: str) -> list[int]:
    out = self.tok.encode(text, add_special_tokens=False)
    return list(out.ids if hasattr(out, "ids") else out)

  def token_id(self, token: str) -> int:
    get = getattr(self.tok, "token_to_id", None)
    tid = get(token) if get is not None else self.tok.convert_tokens_to_ids(token)
    unk = getattr(self.tok, "unk_token_id", None)
    if tid is None or (unk is not None and tid == unk):
      raise ValueError(f"the tokenizer has no token {token!r} (a MiniMax M3 tokenizer is needed for images / "
                       "videos)")
    return int(tid)


def tokenize_expanded(expanded: str, tokenizer: Any) -> list[int]:
  """Token ids of an expanded prompt: marker strings become their ids, the text between them is encoded
  piecewise (equal to encoding the whole string when the markers are added tokens)."""
  tok = _Tokenizer(tokenizer)
  ids = {m: tok.token_id(m) for m in (IMAGE_MARKER, VIDEO_MARKER, VISION_START, VISION_END)}
  pattern = re.compile("(" + "|".join(re.escape(m) for m in ids) + ")")
  out: list[int] = []
  for piece in pattern.split(expanded):
    if piece in ids:
      out.append(ids[piece])
    elif piece:
      out += tok.encode(piece)
  return out


def build_multimodal_inputs(
    prompt: str,
    tokenizer: Any,
    images: Sequence[ImageLike] = (),
    videos: Sequence[Video | np.ndarray] = (),
    *,
    image_config: ImageProcessorConfig = ImageProcessorConfig(),
    video_config: VideoProcessorConfig = VideoProcessorConfig(),
    image_token_id: int | None = None,
    video_token_id: int | None = None,
) -> MultimodalInputs:
  """Prompt text with image / video markers + images (paths, PIL images or uint8 arrays) + videos -> model inputs.

  Args:
    prompt: the full prompt text (chat template already applied); one ``]<]image[>[`` per image and one
      ``]<]video[>[`` per video, in order.
    tokenizer: ``tokenizers.Tokenizer`` or a transformers tokenizer that knows the marker tokens. Text is encoded
      without special tokens (put BOS etc. in the prompt text or prepend it).
    images / videos: in prompt order.
    image_config / video_config: preprocessing settings.
    image_token_id / video_token_id: if given (``model.config.image_token_id``), checked against the tokenizer.

  Returns:
    MultimodalInputs with input_ids int32 [1, S] and HF-format pixel arrays.

  Raises:
    ValueError: marker / item count mismatch, unknown marker tokens, token-id mismatch;
    ImageError: unreadable image or aspect ratio above 200.
  """
  _check_marker_counts(prompt, len(images), len(videos))
  tok = _Tokenizer(tokenizer)
  for marker, want in ((IMAGE_MARKER, image_token_id), (VIDEO_MARKER, video_token_id)):
    if want is not None and tok.token_id(marker) != want:
      raise ValueError(f"tokenizer id of {marker!r} is {tok.token_id(marker)} but the model expects {want}")
  rows, grids = [], []
  for i, image in enumerate(images):
    name = os.fspath(image) if isinstance(image, (str, os.PathLike)) else f"image {i}"
    r, g = image_rows(resized_image(image, image_config, name=name), image_config)
    rows.append(r)
    grids.append(g)
  processed = [preprocess_video(v, video_config, name=f"video {i}") for i, v in enumerate(videos)]
  expanded = expand_prompt(prompt, grids, processed, image_config.merge_size)
  ids = np.asarray([tokenize_expanded(expanded, tokenizer)], np.int32)
  return MultimodalInputs(
      input_ids=ids,
      pixel_values=np.concatenate(rows) if rows else None,
      image_grid_thw=np.asarray(grids, np.int64) if grids else None,
      pixel_values_videos=np.concatenate([p.pixel_values for p in processed]) if processed else None,
      video_grid_thw=np.concatenate([p.grid_thw for p in processed]) if processed else None,
  )
