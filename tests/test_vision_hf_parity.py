"""Vision-language parity with HF transformers 5.23.0 on the committed vl_tiny fixture
(scripts/make_hf_vision_fixtures.py): 3 images with different grids + a 2-temporal-patch video in one prompt."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

import m3jax
from conftest import FIXTURES
from m3jax.checkpoint.safetensors_dir import CheckpointError
from m3jax.vision import (ImageProcessorConfig, Video, build_multimodal_inputs, vision_features,
                          vision_tower_states)
from m3jax.vision.image import IMAGE_STD

DIR = FIXTURES / "vl_tiny"
META = json.loads((DIR / "meta.json").read_text())
REF = np.load(DIR / "reference.npz")
PIXELS = {k: REF[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}


def rel_err(got, ref) -> float:
  return float(np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def model():
  return m3jax.load(DIR / "checkpoint", kernels="reference")


@pytest.mark.quick
def test_fixture_covers_what_the_issue_asks():
  grids = REF["image_grid_thw"].tolist()
  assert len(grids) >= 3 and len({tuple(g) for g in grids}) == len(grids)
  assert REF["video_grid_thw"].tolist() == [[2, 4, 4]]
  cfg = m3jax.M3Config.from_file(DIR / "checkpoint")
  assert cfg.vision.head_dim == 20 and cfg.projector_hidden_size != cfg.text.hidden_size
  assert "sparse" in cfg.text.attention_types and META["robustness"]["pruned_query_rows"] > 0
  assert any(n.startswith("vision_tower.vision_model.") for n in load_file(str(DIR / "checkpoint/model.safetensors")))


@pytest.mark.parametrize("ckpt", ["checkpoint", "checkpoint_hf"])
@pytest.mark.quick
def test_fp32_logits_match_hf(ckpt, model):
  m = model if ckpt == "checkpoint" else m3jax.load(DIR / ckpt, kernels="reference")
  assert m.vision is not None and m.dtype == np.float32
  logits = np.asarray(m(REF["input_ids"], **PIXELS))[0]
  err = rel_err(logits, REF["logits"])
  assert err <= 1e-4, f"{ckpt}: max|d|/max|ref| = {err:.2e}"


def test_vision_tower_and_features_match_hf(model):
  assert rel_err(vision_tower_states(model.vision, REF["pixel_values"], REF["image_grid_thw"]), REF["image_tower"]) <= 1e-4
  assert rel_err(vision_tower_states(model.vision, REF["pixel_values_videos"], REF["video_grid_thw"]),
                 REF["video_tower"]) <= 1e-4
  assert rel_err(vision_features(model.vision, REF["pixel_values"], REF["image_grid_thw"]),
                 REF["image_features"]) <= 1e-4
  assert rel_err(vision_features(model.vision, REF["pixel_values_videos"], REF["video_grid_thw"]),
                 REF["video_features"]) <= 1e-4


def test_video_segments_restart_temporal_positions(model):
  """HF's tower on the video split into 1-temporal-patch grid rows == ours, given either the split grid or the
  whole [[2, 4, 4]] grid with vision_segment_max_frames = 1."""
  ref = REF["video_tower_split1"]
  px = REF["pixel_values_videos"]
  assert rel_err(vision_tower_states(model.vision, px, REF["video_split1_grid_thw"]), ref) <= 1e-4
  whole = vision_tower_states(model.vision, px, REF["video_grid_thw"])
  assert rel_err(whole, ref) > 1e-3  # in one segment the two frames attend to each other: a real difference
  cfg = model.vision.config
  model.vision.config = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, segment_max_frames=1))
  try:
    assert rel_err(vision_tower_states(model.vision, px, REF["video_grid_thw"]), ref) <= 1e-4
  finally:
    model.vision.config = cfg


@pytest.mark.quick
def test_prompt_builder_reproduces_the_hf_processor():
  tok = Tokenizer.from_file(str(DIR / "tokenizer.json"))
  frames = np.load(DIR / META["video"])
  video = Video(frames, native_fps=META["video_metadata"]["fps"],
                frame_indices=tuple(META["video_metadata"]["frames_indices"]))
  inputs = build_multimodal_inputs(META["prompt"], tok, [DIR / p for p in META["images"]], [video],
                                   image_config=ImageProcessorConfig(variant="hf"), image_token_id=250,
                                   video_token_id=251)
  np.testing.assert_array_equal(inputs.input_ids, REF["input_ids"])
  np.testing.assert_array_equal(inputs.image_grid_thw, REF["image_grid_thw"])
  np.testing.assert_array_equal(inputs.video_grid_thw, REF["video_grid_thw"])
  bound = 1 / 255 / min(IMAGE_STD) + 1e-5  # one uint8 level of resize-kernel difference
  assert np.max(np.abs(inputs.pixel_values - REF["pixel_values"])) <= bound
  assert np.max(np.abs(inputs.pixel_values_videos - REF["pixel_values_videos"])) <= bound


@pytest.mark.quick
def test_placeholder_count_mismatch_is_a_clear_error(model):
  ids = REF["input_ids"].copy()
  first = int(np.argmax(ids[0] == 250))
  ids[0, first] = 65
  with pytest.raises(ValueError, match=r"17 image placeholder tokens \(id 250\) but the image inputs give 18"):
    model(ids, **PIXELS)
  with pytest.raises(ValueError, match="pixel_values has shape"):
    model(REF["input_ids"], **{**PIXELS, "pixel_values": REF["pixel_values"][:-4]})
  with pytest.raises(ValueError, match="must be given together"):
    model(REF["input_ids"], pixel_values=REF["pixel_values"])


def test_text_only_load_and_text_only_calls(model):
  text = m3jax.load(DIR / "checkpoint", kernels="reference", text_only=True)
  assert text.vision is None
  ids = np.asarray([[40, 41, 42, 43, 44, 45, 46, 47]], np.int32)
  np.testing.assert_array_equal(np.asarray(text(ids)), np.asarray(model(ids)))
  with pytest.raises(ValueError, match="no vision tower"):
    text(REF["input_ids"], **PIXELS)


def test_missing_vision_tensor_names_it_and_suggests_text_only(tmp_path):
  shutil.copy(DIR / "checkpoint/config.json", tmp_path / "config.json")
  tensors = load_file(str(DIR / "checkpoint/model.safetensors"))
  del tensors["patch_merge_mlp.linear_1.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"missing tensor 'patch_merge_mlp\.linear_1\.weight'.*text_only=True"):
    m3jax.load(tmp_path)
  assert m3jax.load(tmp_path, text_only=True).vision is None
