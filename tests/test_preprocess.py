"""Host preprocessing units: smart_resize, flattening order, RGB conversion, video frames / sampling /
timestamps, prompt expansion, and clear errors for bad inputs."""

import numpy as np
import pytest
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

from m3jax.vision.image import (ImageError, ImageProcessorConfig, image_rows, load_image, normalize, patchify,
                                resized_image, smart_resize, to_rgb)
from m3jax.vision.prompt import (IMAGE_MARKER, VIDEO_MARKER, VISION_END, VISION_START, build_multimodal_inputs,
                                 expand_prompt)
from m3jax.vision.video import Video, preprocess_video, sample_frame_indices, video_timestamps

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier

MARKERS = [IMAGE_MARKER, VIDEO_MARKER, VISION_START, VISION_END]


def char_tokenizer() -> Tokenizer:
  vocab = {"[UNK]": 0, **{chr(c): i + 1 for i, c in enumerate(range(32, 127))}}
  vocab.update({m: 250 + i for i, m in enumerate(MARKERS)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
  return tok


@pytest.mark.parametrize("hw, want", [
    ((224, 224), (224, 224)),
    ((8, 8), (56, 56)),  # min_pixels branch (ceil)
    ((1000, 700), (784, 560)),  # max_pixels branch: beta = sqrt(7e5 / 451584), floor
    ((42, 42), (56, 56)),  # 42 / 28 = 1.5 -> 2 (round half to even), then min_pixels ceil
    ((70, 70), (56, 56)),  # 70 / 28 = 2.5 -> 2 (banker's rounding, not 3)
    ((30, 4000), (28, 4004)),
])
def test_smart_resize_cases(hw, want):
  assert smart_resize(*hw) == want
  h, w = smart_resize(*hw)
  assert h % 28 == 0 and w % 28 == 0 and 3136 <= h * w <= 451584


def test_aspect_ratio_above_200_is_refused():
  with pytest.raises(ImageError, match="aspect ratio 201.0"):
    smart_resize(10, 2010)
  smart_resize(10, 2000)  # exactly 200 is fine
  with pytest.raises(ImageError, match=r"wide\.png: image aspect ratio 250"):
    resized_image(np.zeros((4, 1000, 3), np.uint8), name="wide.png")


def test_unreadable_and_missing_images_are_named(tmp_path):
  bad = tmp_path / "broken.png"
  bad.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
  with pytest.raises(ImageError, match=r"broken\.png: cannot read the image"):
    load_image(bad)
  with pytest.raises(ImageError, match=r"nope\.jpg: no such image file"):
    load_image(tmp_path / "nope.jpg")
  with pytest.raises(ImageError, match="expected a uint8 array"):
    load_image(np.zeros((4, 4, 3), np.float32))


def test_rgba_is_composited_on_white_and_gray_is_replicated():
  rgba = np.zeros((2, 2, 4), np.uint8)
  rgba[0, 0] = [0, 0, 0, 0]  # transparent black -> white
  rgba[0, 1] = [255, 0, 0, 255]  # opaque red stays
  rgba[1, :] = [0, 0, 255, 128]  # half-transparent blue -> blend
  rgb = to_rgb(Image.fromarray(rgba, mode="RGBA"))
  assert rgb[0, 0].tolist() == [255, 255, 255] and rgb[0, 1].tolist() == [255, 0, 0]
  assert rgb[1, 0].tolist() == [127, 127, 255]
  gray = to_rgb(Image.fromarray(np.full((3, 3), 77, np.uint8), mode="L"))
  assert gray.shape == (3, 3, 3) and np.all(gray == 77)


def test_patch_rows_follow_the_block_order_and_channel_time_pixel_layout():
  cfg = ImageProcessorConfig()
  img = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)  # grid 4 x 6
  rows, grid = image_rows(img, cfg)
  assert grid == (1, 4, 6) and rows.shape == (24, 1176)
  norm = normalize(img)
  for i in range(24):  # row i: block (bh, bw), in-block (mh, mw)
    bh, bw, mh, mw = i // 12, (i % 12) // 4, (i % 4) // 2, i % 2
    hp, wp = 2 * bh + mh, 2 * bw + mw
    patch = norm[hp * 14:(hp + 1) * 14, wp * 14:(wp + 1) * 14]  # [py, px, C]
    want = np.stack([patch, patch], 0).transpose(3, 0, 1, 2).reshape(-1)  # (C, T, py, px), frame duplicated
    np.testing.assert_array_equal(rows[i], want)


def test_video_rows_are_time_major_and_chunked():
  frames = np.random.default_rng(1).integers(0, 256, (4, 28, 56, 3), dtype=np.uint8)
  norm = normalize(frames.astype(np.uint8))
  rows, grid = patchify(norm, patch_size=14, merge_size=2, temporal_patch_size=2)
  assert grid == (2, 2, 4)
  t, i = 1, 5  # second temporal patch, 6th patch: block (0, 1), in-block (0, 1) -> hp 0, wp 3
  want = norm[2:4, 0:14, 42:56].transpose(3, 0, 1, 2).reshape(-1)
  np.testing.assert_array_equal(rows[t * 8 + i], want)
  out = preprocess_video(np.zeros((11, 56, 56, 3), np.uint8))  # 11 frames -> 12 -> grid_t 6
  assert out.grid_thw.tolist() == [[4, 4, 4], [2, 4, 4]]
  with pytest.raises(ImageError, match="expected uint8 frames"):
    preprocess_video(np.zeros((2, 28, 28, 3), np.float32))


def test_frame_sampling_and_timestamps():
  assert sample_frame_indices(95, 30.0, fps=1.0) == [0, 30, 60, 90]
  assert sample_frame_indices(10, 2.5, fps=1.0) == [0, 3, 6, 9]  # first frame >= prev kept + 1 s - 1e-4
  assert sample_frame_indices(5, 1.0, fps=4.0) == [0, 1, 2, 3, 4]  # never the same frame twice
  assert sample_frame_indices(3000, 10.0, fps=1.0, max_duration=5.0) == [0, 10, 20, 30, 40]
  assert sample_frame_indices(0, 30.0) == [] and sample_frame_indices(7, 0.0) == [0]
  assert video_timestamps([0, 3, 5], 2.0, grid_t=2) == (0.0, 2.5)
  assert video_timestamps([0, 30, 60, 90, 120], 30.0, grid_t=3) == (0.0, 2.0, 4.0)


def test_prompt_expansion_of_images_and_videos():
  frames = np.zeros((3, 56, 56, 3), np.uint8)
  video = preprocess_video(Video(frames, native_fps=2.0, frame_indices=(0, 3, 5)))
  text = expand_prompt(f"a {IMAGE_MARKER} b {VIDEO_MARKER}", [(1, 4, 6)], [video])
  img = VISION_START + IMAGE_MARKER * 6 + VISION_END
  vid = VISION_START + VIDEO_MARKER * 4 + VISION_END
  assert text == f"a {img} b ]<]0.0 seconds[>[{vid}]<]2.5 seconds[>[{vid}"


def test_build_inputs_and_marker_count_errors(tmp_path):
  tok = char_tokenizer()
  img = np.full((56, 56, 3), 200, np.uint8)
  out = build_multimodal_inputs(f"x{IMAGE_MARKER}y", tok, [img], image_token_id=250)
  assert out.input_ids.tolist() == [[tok.token_to_id("x"), 252] + [250] * 4 + [253, tok.token_to_id("y")]]
  assert out.image_grid_thw.tolist() == [[1, 4, 4]] and out.pixel_values.shape == (16, 1176)
  assert out.pixel_values_videos is None and set(out.pixel_kwargs()) == {"pixel_values", "image_grid_thw"}
  with pytest.raises(ValueError, match=r"1 image marker\(s\) .* but 2 image\(s\) were given"):
    build_multimodal_inputs(f"{IMAGE_MARKER}", tok, [img, img])
  with pytest.raises(ValueError, match=r"0 image marker\(s\)"):
    build_multimodal_inputs("no marker", tok, [img])
  with pytest.raises(ValueError, match=r"1 video marker\(s\) .* but 0 video\(s\)"):
    build_multimodal_inputs(VIDEO_MARKER, tok)
  with pytest.raises(ValueError, match="model expects 9"):
    build_multimodal_inputs(IMAGE_MARKER, tok, [img], image_token_id=9)
  bad = tmp_path / "bad.jpg"
  bad.write_bytes(b"garbage")
  with pytest.raises(ImageError, match=r"bad\.jpg: cannot read"):
    build_multimodal_inputs(IMAGE_MARKER, tok, [bad])
  plain = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
  with pytest.raises(ValueError, match="tokenizer has no token"):
    build_multimodal_inputs(IMAGE_MARKER, plain, [img])
