"""Loading safetensors checkpoints: all layouts, sharding, and clear errors for bad checkpoints."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import m3jax
from m3jax.checkpoint.safetensors_dir import CheckpointError
from m3jax.checkpoint.writer import write_checkpoint


@pytest.fixture(scope="module")
def tiny_model():
  return m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ids():
  return jax.random.randint(jax.random.key(1), (2, 40), 0, 512)


@pytest.mark.parametrize("layout", ["original", "hf", "hf_text"])
@pytest.mark.quick
def test_layouts_load_to_identical_logits(tmp_path, tiny_model, ids, layout):
  files = write_checkpoint(tiny_model, tmp_path, layout=layout, max_shard_bytes=200_000)
  assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  loaded = m3jax.load(tmp_path)
  assert loaded.dtype == jnp.float32
  np.testing.assert_array_equal(loaded(ids), tiny_model(ids))


def test_bf16_checkpoint_loads_as_bf16_and_router_stays_fp32(tmp_path, tiny_model):
  bf16 = m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  write_checkpoint(bf16, tmp_path)
  loaded = m3jax.load(tmp_path)
  assert loaded.dtype == jnp.bfloat16 and loaded.embed[...].dtype == jnp.bfloat16
  assert loaded.layers[1].mlp.router[...].dtype == jnp.float32


def _single_file_checkpoint(tmp_path, model):
  write_checkpoint(model, tmp_path)
  return tmp_path / "model.safetensors"


def _rewrite(path, edit):
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path))


@pytest.mark.quick
def test_missing_tensor_is_named(tmp_path, tiny_model):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"
  _rewrite(f, lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match=r"missing tensor .*experts\.3\.w2\.weight.*\[64, 32\]"):
    m3jax.load(tmp_path)


def test_unexpected_tensor_is_named(tmp_path, tiny_model):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  _rewrite(f, lambda t: t.update({"language_model.model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(CheckpointError, match=r"unexpected tensor .*self_attn\.extra\.weight"):
    m3jax.load(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, tiny_model):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  name = "language_model.model.layers.2.self_attn.index_q_proj.weight"
  _rewrite(f, lambda t: t.update({name: np.zeros((60, 64), np.float32)}))
  with pytest.raises(CheckpointError, match=r"index_q_proj\.weight.*\[60, 64\].*expected \[64, 64\]"):
    m3jax.load(tmp_path)


def test_mtp_tensors_are_skipped_and_unexpected_vision_tensors_raise(tmp_path, tiny_model, ids):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  _rewrite(f, lambda t: t.update({"language_model.model.mtp.layers.0.enorm.weight": np.ones(64, np.float32)}))
  np.testing.assert_array_equal(m3jax.load(tmp_path)(ids), tiny_model(ids))
  # A vision tensor in a checkpoint whose config has no vision_config is unexpected, like any other (#45), even
  # for a text-only load (which skips the vision tower of a config that declares one).
  _rewrite(f, lambda t: t.update({"vision_tower.vision_model.pre_layrnorm.weight": np.ones(32, np.float32)}))
  for text_only in (False, True):
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor "
                                              r"'vision_tower\.vision_model\.pre_layrnorm\.weight' \(shape \[32\]\)"):
      m3jax.load(tmp_path, text_only=text_only)


def test_config_that_does_not_match_the_tensors(tmp_path, tiny_model):
  write_checkpoint(tiny_model, tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["text_config"]["num_local_experts"] = 16
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"gate\.weight' has shape \[8, 64\], expected \[16, 64\]"):
    m3jax.load(tmp_path)


@pytest.mark.quick
def test_truncated_file_and_pickles_are_refused(tmp_path, tiny_model):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  data = f.read_bytes()
  f.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors"):
    m3jax.load(tmp_path)
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  shutil.copy(tmp_path / "config.json", pickled / "config.json")
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
  with pytest.raises(CheckpointError, match="pickle"):
    m3jax.load(pickled)


def test_index_pointing_to_missing_shard(tmp_path, tiny_model):
  write_checkpoint(tiny_model, tmp_path, max_shard_bytes=200_000)
  os.remove(tmp_path / "model-00002-of-00009.safetensors")
  with pytest.raises(CheckpointError, match="missing file 'model-00002-of-00009.safetensors'"):
    m3jax.load(tmp_path)


def test_weights_that_cannot_fit_the_device_fail_before_reading(tmp_path, tiny_model, monkeypatch):
  from m3jax.checkpoint import fit

  write_checkpoint(tiny_model, tmp_path)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(tiny_model)))
  monkeypatch.setattr(fit, "device_limit", lambda device: total - 1)
  with pytest.raises(CheckpointError, match=rf"{tmp_path}: the weights alone need .* but it has"):
    m3jax.load(tmp_path)
  monkeypatch.setattr(fit, "device_limit", lambda device: total)  # exactly the weights' bytes: loads
  assert m3jax.load(tmp_path).dtype == jnp.float32


def test_float16_weights_need_an_explicit_dtype_and_unsupported_dtypes_fail_first(tmp_path, tiny_model):
  f = _single_file_checkpoint(tmp_path, tiny_model)
  _rewrite(f, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items() if v.dtype == np.float32
                                  and "gate.weight" not in k and "correction_bias" not in k}))
  with pytest.raises(CheckpointError, match=r"the weights are float16, which m3jax does not run in; pass dtype="):
    m3jax.load(tmp_path)
  loaded = m3jax.load(tmp_path, dtype="float32")  # fp16 -> fp32 is exact
  assert loaded.dtype == jnp.float32
  reference = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32) if x.dtype == jnp.float32 else x,
                           nnx.state(tiny_model))
  np.testing.assert_array_equal(np.asarray(loaded.embed[...]), np.asarray(reference["embed"][...]))
  for bad, message in (("float16", "dtype float16 is not supported"), (jnp.int8, "dtype int8 is not supported"),
                       ("fp9", "dtype 'fp9' is not a dtype")):
    with pytest.raises(ValueError, match=message):
      m3jax.load(tmp_path, dtype=bad)
  with pytest.raises(CheckpointError, match="is a file; pass the checkpoint directory"):
    m3jax.load(f)
