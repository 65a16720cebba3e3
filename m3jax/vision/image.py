"""Image preprocessing on the host (numpy + PIL; M3_SPEC §7.7): load -> RGB -> smart_resize (factor 28) ->
bicubic resize -> CLIP normalisation -> duplicate to ``temporal_patch_size`` frames -> flatten to HF's patch
rows [gh * gw, C * T * P * P] in spatial-merge-block order.

Resize kernel: PIL's antialiased BICUBIC (a = -0.5, support scaled when shrinking). HF and vLLM resize with
torchvision (``antialias=True``), the same filter in a different fixed-point implementation: on the committed
fixtures the resized images differ by at most 1 uint8 level (0.1% to 23% of the pixels), i.e. at most
1 / 255 / 0.2613 = 0.0150 after normalisation (tests/test_preprocess_hf.py); 2 levels were seen on noisy
synthetic images. Everything after the resize is bit-identical to HF.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
SmartResizeVariant = Literal["vllm", "hf"]
ImageLike = str | os.PathLike | Image.Image | np.ndarray


class ImageError(ValueError):
  """An image that cannot be read or preprocessed (names the image)."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
  """Image preprocessing knobs; defaults are the released MiniMax M3 processor's.

  ``variant`` picks the smart_resize flavour: "vllm" (MiniMax's own, vendored by vLLM; the default) or "hf"
  (transformers 5.23.0). They differ only for images with a side of 14 px or less (see ``smart_resize``).
  """

  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  min_pixels: int = 4 * 28 * 28
  max_pixels: int = 672 * 672
  variant: SmartResizeVariant = "vllm"

  @property
  def factor(self) -> int:
    return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, *, factor: int = 28, min_pixels: int = 4 * 28 * 28,
                 max_pixels: int = 672 * 672, variant: SmartResizeVariant = "vllm") -> tuple[int, int]:
  """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

  Both sides are rounded to the nearest multiple of ``factor`` (Python's banker's rounding); an area above
  ``max_pixels`` scales by beta = sqrt(hw / max) and floors, one below ``min_pixels`` scales up by
  sqrt(min / hw) and ceils. Variants: "vllm" clamps the *rounded* sides to >= factor (so a 10 x 400 image stays
  28 x 392); "hf" clamps only the floored sides, so a side that rounds to 0 sends the image through the
  min_pixels branch instead (10 x 400 -> 28 x 364). With ratios <= 200 and the default bounds the floored
  sides never reach 0, so only a side of 14 px or less (which rounds to 0) whose clamped area is already
  >= min_pixels tells the variants apart.

  Raises:
    ImageError: aspect ratio above 200, or a non-positive side.
  """
  if height <= 0 or width <= 0:
    raise ImageError(f"image size {height}x{width} is empty")
  ratio = max(height, width) / min(height, width)
  if ratio > MAX_ASPECT_RATIO:
    raise ImageError(f"image aspect ratio {ratio:.1f} ({height}x{width}) is above {MAX_ASPECT_RATIO}")
  h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
  if variant == "vllm":
    h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
  elif variant != "hf":
    raise ValueError(f"smart_resize variant {variant!r}: expected 'vllm' or 'hf'")
  if h_bar * w_bar > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h_bar = math.floor(height / beta / factor) * factor
    w_bar = math.floor(width / beta / factor) * factor
    if variant == "hf":
      h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
  elif h_bar * w_bar < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h_bar = math.ceil(height * beta / factor) * factor
    w_bar = math.ceil(width * beta / factor) * factor
  return h_bar, w_bar


def load_image(image: ImageLike, *, name: str | None = None) -> Image.Image:
  """Opens a path (or passes through a PIL image / HxW[xC] uint8 array) and decodes it fully."""
  label = name or (os.fspath(image) if isinstance(image, (str, os.PathLike)) else type(image).__name__)
  if isinstance(image, Image.Image):
    return image
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
      raise ImageError(f"{label}: expected a uint8 array [H, W] or [H, W, 1|3|4], got {image.dtype} "
                       f"{image.shape}")
    return Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
  try:
    with Image.open(os.fspath(image)) as im:
      im.load()
      return im.copy()
  except FileNotFoundError:
    raise ImageError(f"{label}: no such image file") from None
  except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
    raise ImageError(f"{label}: cannot read the image ({type(e).__name__}: {e})") from None


def to_rgb(image: Image.Image) -> np.ndarray:
  """uint8 [H, W, 3]; transparency is composited onto white (as HF's convert_to_rgb does)."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    image = Image.alpha_composite(white, rgba)
  return np.asarray(image.convert("RGB"), dtype=np.uint8)


def resize_bicubic(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [H, W, 3] -> uint8 [height, width, 3] with PIL's antialiased bicubic (identity when same size)."""
  if rgb.shape[:2] == (height, width):
    return rgb
  return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC), dtype=np.uint8)


def normalize(rgb: np.ndarray) -> np.ndarray:
  """uint8 [..., 3] -> float32 (x - 255 * mean) / (255 * std), HF's fused rescale + normalise, in fp32."""
  mean = np.asarray(IMAGE_MEAN, np.float32) * np.float32(255.0)
  std = np.asarray(IMAGE_STD, np.float32) * np.float32(255.0)
  return (rgb.astype(np.float32) - mean) / std


def patchify(frames: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int
             ) -> tuple[np.ndarray, tuple[int, int, int]]:
  """frames float [T, H, W, C] (T a multiple of temporal_patch_size; H, W multiples of patch * merge) ->
  (rows [gt * gh * gw, C * tps * P * P] ordered t, block-row, block-col, in-row, in-col; each row (C, T, py, px),
  (gt, gh, gw))."""
  t, h, w, c = frames.shape
  p, m, tp = patch_size, merge_size, temporal_patch_size
  if t % tp or h % (p * m) or w % (p * m):
    raise ValueError(f"patchify: frames {frames.shape} need T % {tp} == 0 and H, W multiples of {p * m}")
  gt, gh, gw = t // tp, h // p, w // p
  x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
  x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # gt, bh, bw, mh, mw, C, T, py, px
  return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)


def resized_image(image: ImageLike, cfg: ImageProcessorConfig = ImageProcessorConfig(), *,
                  name: str | None = None) -> np.ndarray:
  """The uint8 [h', w', 3] image after RGB conversion and smart_resize + bicubic resize."""
  rgb = to_rgb(load_image(image, name=name))
  try:
    h, w = smart_resize(rgb.shape[0], rgb.shape[1], factor=cfg.factor, min_pixels=cfg.min_pixels,
                        max_pixels=cfg.max_pixels, variant=cfg.variant)
  except ImageError as e:
    raise ImageError(f"{name or 'image'}: {e}") from None
  return resize_bicubic(rgb, h, w)


def image_rows(resized: np.ndarray, cfg: ImageProcessorConfig = ImageProcessorConfig()
               ) -> tuple[np.ndarray, tuple[int, int, int]]:
  """A resized uint8 [h', w', 3] image -> (float32 rows [gh * gw, 3 * T * P * P], (1, gh, gw)); the single
  frame is duplicated to temporal_patch_size identical frames."""
  frames = np.repeat(normalize(resized)[None], cfg.temporal_patch_size, axis=0)
  return patchify(frames, patch_size=cfg.patch_size, merge_size=cfg.merge_size,
                  temporal_patch_size=cfg.temporal_patch_size)


def preprocess_images(images: Sequence[ImageLike], cfg: ImageProcessorConfig = ImageProcessorConfig()
                      ) -> tuple[np.ndarray, np.ndarray]:
  """Images -> (pixel_values float32 [sum gh*gw, 1176], image_grid_thw int64 [num_images, 3]), HF's format."""
  rows, grids = [], []
  for i, image in enumerate(images):
    name = os.fspath(image) if isinstance(image, (str, os.PathLike)) else f"image {i}"
    r, grid = image_rows(resized_image(image, cfg, name=name), cfg)
    rows.append(r)
    grids.append(grid)
  dim = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
  pixel_values = np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
  return pixel_values, np.asarray(grids, np.int64).reshape(-1, 3)


def num_image_tokens(height: int, width: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> int:
  """LLM placeholder tokens of an image of the given original size: gh * gw / merge^2."""
  h, w = smart_resize(height, width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                      variant=cfg.variant)
  return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size ** 2
