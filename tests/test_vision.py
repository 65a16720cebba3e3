"""Vision tower / projector units on a random tiny model: segment isolation (no cross-image attention, no padding
leak), video segment splitting, block-order RoPE positions, 78-of-80 axial RoPE, conv == matmul patch embedding,
2x2 merge grouping, placeholder scatter, checkpoint round trips, and the unchanged text-only path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import m3jax
from m3jax.checkpoint.vision_mapping import vision_rules
from m3jax.checkpoint.writer import write_checkpoint
from m3jax.layers.rope import apply_partial_rope
from m3jax.vision import VisionModel, check_placeholders, scatter_features, vision_features, vision_layout, vision_tower_states
from m3jax.vision.layers import gelu
from m3jax.vision.rope import axial_cos_sin, axial_rotary_dim

CFG = m3jax.tiny(vision=True)


@pytest.fixture(scope="module")
def model():
  return m3jax.M3ForCausalLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(7), with_vision=True)


def pixels(n: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(n, 1176)).astype(np.float32)


@pytest.mark.quick
def test_images_never_attend_to_each_other_and_padding_never_leaks(model):
  ga, gb, gc = [1, 4, 6], [1, 2, 2], [1, 6, 4]
  a, b, c = pixels(24, 1), pixels(4, 2), pixels(24, 3)
  alone = [np.asarray(vision_tower_states(model.vision, x, [g])) for x, g in ((a, ga), (b, gb), (c, gc))]
  together = np.asarray(vision_tower_states(model.vision, np.concatenate([b, a, c]), [gb, ga, gc]))
  # b (4 patches) is padded to the 24-patch segment length when packed with a and c
  np.testing.assert_allclose(together[:4], alone[1], atol=1e-5, rtol=0)  # fp32 reduction-order noise only
  np.testing.assert_allclose(together[4:28], alone[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(together[28:], alone[2], atol=1e-5, rtol=0)
  feats = np.asarray(vision_features(model.vision, np.concatenate([a, b]), [ga, gb]))
  assert feats.shape == (7, CFG.text.hidden_size)
  np.testing.assert_allclose(feats[6:], np.asarray(vision_features(model.vision, b, [gb])), atol=1e-5, rtol=0)


def test_long_videos_split_into_segments_with_restarting_time(model):
  px = pixels(6 * 8, 4)
  split = np.asarray(vision_tower_states(model.vision, px, [[4, 2, 4], [2, 2, 4]]))
  auto = np.asarray(vision_tower_states(model.vision, px, [[6, 2, 4]]))  # segment_max_frames = 4 by default
  np.testing.assert_allclose(auto, split, atol=1e-5, rtol=0)
  lay = vision_layout([[6, 2, 4]], merge=2, max_frames=4)
  assert lay.segments == ((0, 32), (32, 16)) and lay.positions[32:, 0].tolist() == [0] * 8 + [1] * 8
  whole_cfg = dataclasses.replace(CFG, vision=dataclasses.replace(CFG.vision, segment_max_frames=0))
  vision, cfg = model.vision, model.vision.config
  vision.config = whole_cfg
  try:
    whole = np.asarray(vision_tower_states(vision, px, [[6, 2, 4]]))
  finally:
    vision.config = cfg
  assert np.max(np.abs(whole - auto)) > 1e-3


@pytest.mark.quick
def test_positions_follow_the_spatial_merge_block_order():
  t, h, w = 2, 4, 6
  lay = vision_layout([[t, h, w]], merge=2, max_frames=None)
  for i, (tp, hp, wp) in enumerate(lay.positions.tolist()):
    j = i % (h * w)
    bh, bw = j // (2 * w), (j % (2 * w)) // 4
    assert (tp, hp, wp) == (i // (h * w), 2 * bh + (j % 4) // 2, 2 * bw + j % 2), i


def test_axial_rope_rotates_78_of_80_channels_in_fp32():
  assert axial_rotary_dim(80) == 78 and axial_rotary_dim(20) == 18 and axial_rotary_dim(16) == 12
  pos = jnp.asarray([[[3, 5, 7]]])
  cos, sin = axial_cos_sin(pos, 80, 10000.0)
  assert cos.shape == (1, 1, 78) and cos.dtype == jnp.float32
  inv = 1.0 / 10000.0 ** (np.arange(0, 26, 2) / 26)
  np.testing.assert_allclose(np.asarray(cos[0, 0, :39]), np.cos(np.concatenate([3 * inv, 5 * inv, 7 * inv])),
                             rtol=0, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(cos[0, 0, 39:]), np.asarray(cos[0, 0, :39]))
  x = jax.random.normal(jax.random.key(0), (1, 1, 2, 80), jnp.bfloat16)
  y = apply_partial_rope(x, cos, sin)
  np.testing.assert_array_equal(np.asarray(y[..., 78:]), np.asarray(x[..., 78:]))
  assert not np.array_equal(np.asarray(y[..., :78]), np.asarray(x[..., :78]))


def test_patch_embedding_is_the_conv3d(model):
  rule = next(r for r in vision_rules(CFG, "original") if r.path[-1] == "patch_embed")
  w = np.asarray(model.vision.tower.patch_embed[...])
  (conv,) = rule.from_param(w)
  assert conv.shape == (32, 3, 2, 14, 14)
  px = pixels(5, 5)
  want = np.einsum("nctyx,dctyx->nd", px.reshape(5, 3, 2, 14, 14), conv)  # stride == kernel: one output per row
  np.testing.assert_allclose(px @ w, want, rtol=1e-5, atol=1e-5)


def test_projector_merges_each_run_of_four_patches(model):
  proj = model.vision.projector
  x = jnp.asarray(pixels(8, 6)[:, :32])
  y = proj.linear_2(gelu(proj.linear_1(x)))
  manual = np.stack([np.asarray(proj.merge_linear_2(gelu(proj.merge_linear_1(y[i:i + 4].reshape(1, -1)))))[0]
                     for i in (0, 4)])
  np.testing.assert_allclose(np.asarray(proj(x)), manual, rtol=1e-6, atol=1e-6)


@pytest.mark.quick
def test_scatter_in_order_and_clear_count_errors():
  ids = jnp.asarray([[1, 9, 9, 2], [9, 3, 9, 4]])
  feats = jnp.arange(4 * 2, dtype=jnp.float32).reshape(4, 2) + 100
  out = np.asarray(scatter_features(jnp.zeros((2, 4, 2)), ids, 9, feats))
  np.testing.assert_array_equal(out[0, 1:3], [[100, 101], [102, 103]])
  np.testing.assert_array_equal(out[1, [0, 2]], [[104, 105], [106, 107]])
  assert np.all(out[0, [0, 3]] == 0)
  with pytest.raises(ValueError, match=r"3 image placeholder tokens \(id 500\) but the image inputs give 4"):
    check_placeholders(np.asarray([[500, 500, 500]]), CFG, 4, 0)
  with pytest.raises(ValueError, match=r"1 video placeholder tokens \(id 501\) but the video inputs give 0"):
    check_placeholders(np.asarray([[501]]), CFG, 0, 0)


def test_text_only_call_is_unchanged_by_the_vision_tower(model):
  text = m3jax.M3ForCausalLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(7))  # same seed: the vision tower is drawn last
  assert text.vision is None
  np.testing.assert_array_equal(np.asarray(text.lm_head[...]), np.asarray(model.lm_head[...]))
  ids = np.asarray([[1, 2, 3, 4, 5, 6]], np.int32)
  np.testing.assert_array_equal(np.asarray(text(ids)), np.asarray(model(ids)))
  with pytest.raises(ValueError, match="with_vision=True needs a config with a vision_config"):
    m3jax.M3ForCausalLM(m3jax.tiny(), with_vision=True)


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_vision_checkpoint_round_trip(tmp_path, model, layout):
  write_checkpoint(model, tmp_path, layout=layout)
  loaded = m3jax.load(tmp_path)
  assert loaded.vision is not None
  ids = np.asarray([[7, 500, 500, 8, 501, 501, 9]], np.int32)
  kw = dict(pixel_values=pixels(8, 8), image_grid_thw=[[1, 2, 4]], pixel_values_videos=pixels(8, 9),
            video_grid_thw=[[2, 2, 2]])
  np.testing.assert_array_equal(np.asarray(loaded(ids, **kw)), np.asarray(model(ids, **kw)))
  embeds = model.embed_multimodal(ids, **kw)
  logits = model.forward(jnp.asarray(ids), inputs_embeds=embeds).logits
  np.testing.assert_allclose(np.asarray(logits), np.asarray(model(ids, **kw)), rtol=1e-6, atol=1e-6)


def test_bf16_vision_path_runs_close_to_fp32(model):
  bf16 = VisionModel(CFG, dtype=jnp.bfloat16, rngs=None)
  nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model.vision, nnx.Param)))
  assert bf16.tower.patch_embed[...].dtype == jnp.bfloat16
  px, grid = pixels(24, 10), [[1, 4, 6]]
  got = np.asarray(vision_features(bf16, px, grid), np.float32)
  ref = np.asarray(vision_features(model.vision, px, grid))
  assert np.all(np.isfinite(got)) and np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 5e-2
