"""Host preprocessing vs HF transformers 5.23.0's MiniMaxM3VL image / video processors (committed outputs from
scripts/make_hf_vision_fixtures.py; CI has no torch).

Measured resize-kernel difference (PIL bicubic here, torchvision antialiased bicubic in HF): at most 1 uint8 level
on every committed image (0.1%-23% of pixels differ by 1), i.e. at most 1 / 255 / 0.26130258 = 0.01501 after
normalisation; everything after the resize (normalisation, duplication, patch order) is bit-exact.
"""

import json

import numpy as np
import pytest

from conftest import FIXTURES
from m3jax.vision.image import (IMAGE_STD, ImageProcessorConfig, image_rows, num_image_tokens, preprocess_images,
                                resized_image, smart_resize)
from m3jax.vision.video import preprocess_video

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier

DIR = FIXTURES / "vl_preprocess"
META = json.loads((DIR / "meta.json").read_text())
HF = np.load(DIR / "hf_outputs.npz")
RESIZE_LEVELS = 1  # max |uint8 difference| between PIL's and torchvision's bicubic on these inputs
PIXEL_BOUND = RESIZE_LEVELS / 255 / min(IMAGE_STD) + 1e-5
HF_CFG = ImageProcessorConfig(variant="hf")
IMAGES = sorted(META["images"])


def test_fixture_covers_the_required_cases():
  sizes = {k: v["size_hw"] for k, v in META["images"].items()}
  modes = {v["mode"] for v in META["images"].values()}
  assert len(IMAGES) >= 6 and {"L", "RGBA", "RGB"} <= modes
  assert min(min(s) for s in sizes.values()) <= 8  # tiny
  assert max(h * w for h, w in sizes.values()) > 4 * 672 * 672  # huge: the max_pixels branch
  assert max(max(s) / min(s) for s in sizes.values()) > 100  # extreme aspect ratio
  assert any(v["file"].endswith(".jpg") for v in META["images"].values())


@pytest.mark.parametrize("key", IMAGES)
def test_grid_and_token_count_match_hf(key):
  e = META["images"][key]
  h, w = e["size_hw"]
  resized = resized_image(DIR / e["file"], HF_CFG)
  rows, grid = image_rows(resized, HF_CFG)
  assert list(grid) == e["grid_thw"] and list(resized.shape[:2]) == e["resized_hw"]
  assert rows.shape == (e["num_tokens"] * 4, 1176)
  assert num_image_tokens(h, w, HF_CFG) == e["num_tokens"]


@pytest.mark.parametrize("key", IMAGES)
def test_pixel_values_within_the_resize_kernel_difference(key):
  e = META["images"][key]
  rows, _ = image_rows(resized_image(DIR / e["file"], HF_CFG), HF_CFG)
  n = META["sub_rows"]
  assert np.max(np.abs(rows[:n] - HF[f"{key}__head"])) <= PIXEL_BOUND
  assert np.max(np.abs(rows[-n:] - HF[f"{key}__tail"])) <= PIXEL_BOUND
  per_channel = rows.reshape(rows.shape[0], 3, -1).transpose(1, 0, 2).reshape(3, -1).astype(np.float64)
  np.testing.assert_allclose(per_channel.mean(1), e["stats"]["mean"], atol=2e-4)
  np.testing.assert_allclose(per_channel.std(1), e["stats"]["std"], atol=2e-3)
  np.testing.assert_allclose(per_channel.min(1), e["stats"]["min"], atol=PIXEL_BOUND)
  np.testing.assert_allclose(per_channel.max(1), e["stats"]["max"], atol=PIXEL_BOUND)


@pytest.mark.parametrize("key", [k for k in IMAGES if META["images"][k].get("resized_stored")])
def test_resize_differs_by_at_most_one_level_and_the_rest_is_exact(key):
  e = META["images"][key]
  ours = resized_image(DIR / e["file"], HF_CFG)
  ref = HF[f"{key}__resized"]
  assert np.max(np.abs(ours.astype(int) - ref.astype(int))) <= RESIZE_LEVELS
  rows, _ = image_rows(ref, HF_CFG)  # normalisation + duplication + patch order from HF's own resized pixels
  n = META["sub_rows"]
  np.testing.assert_array_equal(rows[:n], HF[f"{key}__head"])
  np.testing.assert_array_equal(rows[-n:], HF[f"{key}__tail"])


def test_batch_of_images_concatenates_in_order():
  paths = [DIR / META["images"][k]["file"] for k in ("tiny_8x8", "rgba_120x90", "gray_150x200")]
  pv, grid = preprocess_images(paths, HF_CFG)
  assert grid.tolist() == [META["images"][k]["grid_thw"] for k in ("tiny_8x8", "rgba_120x90", "gray_150x200")]
  assert pv.shape == (int(np.prod(grid, 1).sum()), 1176) and pv.dtype == np.float32
  n = META["sub_rows"]
  assert np.max(np.abs(pv[16:16 + n] - HF["rgba_120x90__head"])) <= PIXEL_BOUND


def test_variants_differ_only_on_sides_of_14px_or_less():
  """HF leaves a side that rounds to 0 unclamped (min_pixels branch); MiniMax/vLLM clamps it to 28 first."""
  e = META["images"]["thin_10x400"]
  assert e["grid_thw"] == [1, 2, 26]  # HF: 10x400 -> 28x364
  assert smart_resize(10, 400, variant="hf") == (28, 364)
  assert smart_resize(10, 400, variant="vllm") == (28, 392)
  grid = image_rows(resized_image(DIR / e["file"]), ImageProcessorConfig())[1]
  assert grid == (1, 2, 28)
  for key in IMAGES:
    if key != "thin_10x400":
      h, w = META["images"][key]["size_hw"]
      assert smart_resize(h, w, variant="vllm") == smart_resize(h, w, variant="hf"), key
  for h in range(1, 200):
    for w in (h, 3 * h, 150 * h):
      if w / h <= 200 and smart_resize(h, w, variant="hf") != smart_resize(h, w, variant="vllm"):
        assert min(h, w) <= 14, (h, w)


def test_video_matches_hf_video_processor():
  v = META["video"]
  frames = np.load(DIR / v["file"])
  assert len(frames) % 2 == 1  # exercises the even-count padding
  out = preprocess_video(frames)
  assert out.grid_thw.tolist() == v["grid_thw"] == [[4, 4, 4], [1, 4, 4]]  # 9 frames -> 5 temporal patches
  assert out.timestamps is None
  ref = HF["video__pixel_values"]
  assert out.pixel_values.shape == ref.shape
  assert np.max(np.abs(out.pixel_values - ref)) <= PIXEL_BOUND
  # the padded 10th frame repeats the 9th: both halves of the last temporal patch are equal
  last = out.pixel_values[-16:].reshape(16, 3, 2, 14 * 14)
  np.testing.assert_array_equal(last[:, :, 0], last[:, :, 1])
