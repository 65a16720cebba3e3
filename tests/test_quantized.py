"""Quantized checkpoints (MXFP8, FP8 block-scaled, NVFP4): dequantization math against independent float64
references, quantization_config handling, and quantized copies of the flat_b16 fixture end to end."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax.numpy as jnp

import m3jax
from conftest import FIXTURES
from m3jax.checkpoint import quantized as q
from m3jax.checkpoint.convert import convert
from m3jax.checkpoint.inspect import inspect_checkpoint
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.checkpoint.safetensors_stream import read_tensor
from m3jax.checkpoint.source import TensorSource
from m3jax.generate import generate
from pallas_kernels import quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FLAT_B16 = FIXTURES / "flat_b16" / "checkpoint"


# ----------------------------------------------------------------------------------------------------------
# Independent float64 references (no m3jax code)


def ref_blocked(w8: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """e4m3 [out, in] x per-block scale (uint8 E8M0 or float) -> float64."""
  out, inp = w8.shape
  s = 2.0 ** (scale.astype(np.int64) - 127) if scale.dtype == np.uint8 else scale.astype(np.float64)
  rows, cols = np.arange(out)[:, None] // block[0], np.arange(inp)[None, :] // block[1]
  return w8.astype(np.float64) * s[rows, cols]


def ref_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
  out, half = packed.shape
  w = np.zeros((out, 2 * half))
  for r in range(out):
    for j in range(half):
      for k, nib in enumerate((packed[r, j] & 0xF, packed[r, j] >> 4)):  # low nibble = even element
        w[r, 2 * j + k] = (-1.0 if nib & 8 else 1.0) * E2M1[nib & 7]
  eff = scale.astype(np.float64) / float(global_scale.reshape(-1)[0])
  return w * eff[:, np.arange(2 * half) // 16]


def random_e4m3(rng, shape) -> np.ndarray:
  """Random finite e4m3 codes (every representable magnitude, both signs)."""
  codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
  codes = np.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # drop NaN codes
  return codes.view(ml_dtypes.float8_e4m3fn)


# ----------------------------------------------------------------------------------------------------------
# Math


@pytest.mark.quick
def test_mxfp8_dequantize_exact_and_bounded():
  rng = np.random.default_rng(0)
  w8 = random_e4m3(rng, (24, 96))
  scale = rng.integers(127 - 10, 127 + 10, size=(24, 3), dtype=np.uint8)
  block = (1, 32)
  got = q.dequantize_blocked(w8, scale, block)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, ref_blocked(w8, scale, block).astype(np.float32))
  # Round trip of arbitrary values: within half an e4m3 ulp (2^-4 relative) or the subnormal step of the block.
  w = (rng.standard_normal((24, 80)) * rng.uniform(0.01, 100, size=(24, 1))).astype(np.float32)
  w8, scale = q.quantize_mxfp8(w)
  assert scale.shape == (24, 3)  # 80 inputs: the last block is partial
  deq = q.dequantize_blocked(w8, scale, (1, 32))
  step = 2.0 ** (scale.astype(np.float64) - 127)[:, np.arange(80) // 32]
  assert np.all(np.abs(deq - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -9 * step)


@pytest.mark.quick
def test_fp8_block_dequantize_exact_and_bounded():
  rng = np.random.default_rng(1)
  w8 = random_e4m3(rng, (200, 300))  # not multiples of 128: ragged last blocks
  scale = rng.uniform(0.001, 2.0, size=(2, 3)).astype(np.float32)
  block = (128, 128)
  assert q.scale_grid(w8.shape, block) == scale.shape
  np.testing.assert_array_equal(q.dequantize_blocked(w8, scale, block),
                                (ref_blocked(w8, scale, block)).astype(np.float32))
  w = rng.standard_normal((200, 300)).astype(np.float32)
  w8, scale = q.quantize_fp8_block(w)
  deq = q.dequantize_blocked(w8, scale, (128, 128))
  step = scale.astype(np.float64)[np.arange(200)[:, None] // 128, np.arange(300)[None, :] // 128]
  assert np.all(np.abs(deq - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -9 * step)


@pytest.mark.quick
def test_nvfp4_nibble_order_exact_and_bounded():
  # 0x2A: low nibble 0xA = sign + magnitude code 2 (1.0) -> element 0 is -1.0; high nibble 0x2 -> element 1 is +1.0.
  np.testing.assert_array_equal(q.unpack_e2m1(np.array([[0x2A, 0xF7]], np.uint8)), [[-1.0, 1.0, 6.0, -6.0]])
  rng = np.random.default_rng(2)
  packed = rng.integers(0, 256, size=(6, 24), dtype=np.uint8)
  scale = random_e4m3(rng, (6, 3))
  scale = np.abs(scale.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
  gscale = np.array([256.0], np.float32)
  got = q.dequantize_nvfp4(packed, scale, gscale)
  np.testing.assert_array_equal(got, ref_nvfp4(packed, scale, gscale).astype(np.float32))
  w = rng.standard_normal((16, 64)).astype(np.float32)
  packed, scale, gscale = q.quantize_nvfp4(w)
  deq = q.dequantize_nvfp4(packed, scale, gscale)
  eff = np.repeat(scale.astype(np.float32) / gscale[0], 16, axis=1)
  assert np.all(np.abs(deq - w) <= eff)  # half the largest E2M1 gap (4 -> 6) times the group scale


def test_ignored_layer_matching():
  cfg = q.QuantConfig(method="mxfp8", ignored=("lm_head", "block_sparse_moe.gate", "re:.*vision_tower.*"))
  assert cfg.is_ignored("language_model.lm_head")
  assert cfg.is_ignored("language_model.model.layers.3.block_sparse_moe.gate")
  assert not cfg.is_ignored("language_model.model.layers.3.block_sparse_moe.shared_experts.gate_proj")
  assert cfg.is_ignored("vision_tower.vision_model.encoder.layers.0.mlp.fc1")
  ct = q.QuantConfig.from_config({"quantization_config": {
      "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["re:.*experts\\.\\d+\\..*"]}}}})
  assert ct.expects_quantized("language_model.model.layers.0.block_sparse_moe.experts.3.w1")
  assert not ct.expects_quantized("language_model.model.layers.0.self_attn.q_proj")


# ----------------------------------------------------------------------------------------------------------
# Quantized copies of the flat_b16 fixture


FORMATS = {
    "mxfp8": {"quant_method": "mxfp8",
              "ignored_layers": ["lm_head", "block_sparse_moe.gate", "vision_tower", "multi_modal_projector",
                                 "patch_merge_mlp"]},
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [16, 16],
                  "modules_to_not_convert": ["lm_head", "gate", "vision_tower", "multi_modal_projector",
                                             "patch_merge_mlp"]},
    "fp8_block_e8m0": {"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "ue8m0",
                       "ignored_layers": ["lm_head", "gate", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]},
    "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "config_groups": {"group_0": {"targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"]}},
              "ignore": ["lm_head"]},
}
FORMAT_OF = {"fp8_block_e8m0": "fp8_block"}  # the format a FORMATS entry declares, where its key differs


def quantize_checkpoint(src, dst, fmt: str) -> dict[str, np.ndarray]:
  """Writes a quantized copy of ``src`` (config + one safetensors file) and returns the float32 tensors that the
  quantized checkpoint represents (dequantized with the float64 references above)."""
  source = TensorSource.open(src)
  qcfg = q.QuantConfig.from_config({"quantization_config": FORMATS[fmt]})
  tensors, dequantized = {}, {}
  for name in source.keys():
    w = source.get(name)
    module = name[: -len(".weight")]
    if not (q.is_linear_weight(name, w.ndim) and qcfg.expects_quantized(module)):
      tensors[name] = dequantized[name] = w
      continue
    if fmt == "mxfp8":
      w8, s = q.quantize_mxfp8(w)
      tensors |= {name: w8, module + ".weight_scale_inv": s}
      dequantized[name] = ref_blocked(w8, s, (1, 32)).astype(np.float32)
    elif fmt == "fp8_block":
      w8, s = q.quantize_fp8_block(w, (16, 16))
      tensors |= {name: w8, module + ".weight_scale_inv": s}
      dequantized[name] = ref_blocked(w8, s, (16, 16)).astype(np.float32)
    elif fmt == "fp8_block_e8m0":  # power-of-two scales stored as E8M0 bytes (DeepSeek V3.1 style)
      qw = quant.quantize(jnp.asarray(w), "fp8_block", (16, 16), jnp.dtype(jnp.uint8))
      w8, s = np.asarray(qw.values), np.asarray(qw.scales)
      tensors |= {name: w8, module + ".weight_scale_inv": s}
      dequantized[name] = ref_blocked(w8, s, (16, 16)).astype(np.float32)
    else:
      packed, s, g = q.quantize_nvfp4(w)
      tensors |= {module + ".weight_packed": packed, module + ".weight_scale": s, module + ".weight_global_scale": g,
                  module + ".input_global_scale": np.ones(1, np.float32)}
      dequantized[name] = ref_nvfp4(packed, s, g).astype(np.float32)
  dst.mkdir()
  save_file(tensors, str(dst / "model.safetensors"))
  cfg = json.loads((src / "config.json").read_text())
  cfg["quantization_config"] = FORMATS[fmt]
  (dst / "config.json").write_text(json.dumps(cfg))
  return dequantized


def write_plain(tensors: dict[str, np.ndarray], src, dst) -> None:
  dst.mkdir()
  save_file(tensors, str(dst / "model.safetensors"))
  shutil.copy(src / "config.json", dst / "config.json")


def params(model) -> dict:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.quick
def test_quantized_fixture_end_to_end(tmp_path, fmt):
  dequantized = quantize_checkpoint(FLAT_B16, tmp_path / "quant", fmt)
  write_plain(dequantized, FLAT_B16, tmp_path / "plain")
  source = TensorSource.open(tmp_path / "quant")
  formats = {source.quant_format(n) for n in source.keys()}
  assert formats == {None, FORMAT_OF.get(fmt, fmt)}
  assert source.quant_format("language_model.model.layers.0.block_sparse_moe.gate.weight") is None  # ignored
  quant_model = m3jax.load(tmp_path / "quant", kernels="reference")
  plain_model = m3jax.load(tmp_path / "plain", kernels="reference")
  a, b = params(quant_model), params(plain_model)
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  # keep_quantized: fp8 formats keep every quantized linear as stored, and each dequantizes exactly to the plain
  # model's parameter (in m3jax's layout); NVFP4 keeps the routed experts packed (the only NVFP4 tensors here).
  kept_model = m3jax.load(tmp_path / "quant", kernels="reference", keep_quantized=True)
  kept = params(kept_model)
  fp8 = {k[:-1] for k in kept if k[-1] == "values"}
  assert len(fp8) == (4 if fmt == "nvfp4" else 20)  # 2 layers x (4 attention + 2 indexer + 4 MLP), or 2 x 2 experts
  for path in fp8:
    if fmt == "nvfp4":
      assert path[-1] in ("w_gate_up", "w_down")
      packed, s, g = kept[path + ("values",)], kept[path + ("scales",)], kept[path + ("global_scale",)]
      assert (packed.dtype, s.dtype, g.dtype) == (np.uint8, ml_dtypes.float8_e4m3fn, np.float32)
      assert g.shape == (packed.shape[0], 2 if path[-1] == "w_gate_up" else 1)
      rows = np.repeat(g, packed.shape[1] // g.shape[1], axis=1)  # the multipliers are the stored divisors inverted
      w = q.unpack_e2m1(packed) * np.repeat(s.astype(np.float32), 16, axis=-1) * rows[..., None]
    else:
      blocks = (1, 32) if fmt == "mxfp8" else (16, 16)
      w = q.dequantize_blocked(kept[path + ("values",)], kept[path + ("scales",)], blocks)
    np.testing.assert_array_equal(np.swapaxes(w, -1, -2).reshape(b[path].shape), b[path])
  assert all(np.array_equal(kept[k], b[k]) for k in b if k[:-1] not in fp8 and k in kept)
  if fmt == "nvfp4":  # the packed experts' model: fp32 logits and greedy tokens of the dequantized model
    ids = np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"][:, :40]
    want = np.asarray(plain_model(ids))
    assert np.abs(np.asarray(kept_model(ids)) - want).max() <= 1e-5 * np.abs(want).max()
    prompts = [ids[0, :12].tolist()]
    np.testing.assert_array_equal(generate(kept_model, prompts, max_new_tokens=4, eos_token_ids=()).tokens,
                                  generate(plain_model, prompts, max_new_tokens=4, eos_token_ids=()).tokens)
  if fmt == "mxfp8":  # identical parameters give identical logits; run the forward once to show it end to end
    ids = np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"][:, :40]
    np.testing.assert_array_equal(np.asarray(quant_model(ids)), np.asarray(plain_model(ids)))
  # convert dequantizes the same way (bf16 target: the cast of the same fp32 values).
  report, plain = inspect_checkpoint(tmp_path / "quant"), inspect_checkpoint(tmp_path / "plain")
  assert report.quantization == FORMATS[fmt]["quant_method"] and "F8_E4M3" in report.dtypes
  assert {k: n for k, (n, _) in report.params.items()} == {k: n for k, (n, _) in plain.params.items()}
  assert report.params["routed experts"][1] < plain.params["routed experts"][1] / 3  # bytes stored
  summary = convert(tmp_path / "quant", tmp_path / "dst", dtype="bfloat16", progress=False)
  assert summary.dequantized[FORMAT_OF.get(fmt, fmt)] > 0 and summary.quantization == FORMATS[fmt]["quant_method"]
  c = params(m3jax.load(tmp_path / "dst"))
  d = params(m3jax.load(tmp_path / "plain", dtype="bfloat16"))
  assert all(np.array_equal(c[k], d[k]) for k in c)


def test_quantization_config_mismatches_are_named(tmp_path):
  quantize_checkpoint(FLAT_B16, tmp_path / "q", "mxfp8")
  cfg_path = tmp_path / "q" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  # An ignored module that nevertheless has scales.
  cfg["quantization_config"]["ignored_layers"].append("self_attn.q_proj")
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_proj\.weight' is quantized \(mxfp8\) but "
                                            r"quantization_config lists"):
    m3jax.load(tmp_path / "q")
  # A module the config quantizes but that is stored in plain float.
  cfg["quantization_config"]["ignored_layers"] = ["lm_head"]
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"block_sparse_moe\.gate\.weight' is stored unquantized"):
    m3jax.load(tmp_path / "q")
  # Quantized tensors but no quantization_config at all.
  del cfg["quantization_config"]
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"is quantized \(with .*weight_scale_inv'\) but config.json has no "
                                            r"quantization_config"):
    convert(tmp_path / "q", tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_malformed_quantized_tensors_are_named(tmp_path):
  w8, s = q.quantize_mxfp8(np.ones((32, 48), np.float32))
  d = tmp_path / "bad"
  d.mkdir()
  save_file({"a.weight": w8, "a.weight_scale_inv": np.ascontiguousarray(s[:5, :1])}, str(d / "model.safetensors"))
  (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp8"}}))
  with pytest.raises(CheckpointError, match=r"model\.safetensors: 'a\.weight_scale_inv' has shape \[5, 1\] but mxfp8 "
                                            r"\(quant_method 'mxfp8', blocks of 1x32\) implies \[32, 2\] for 'a\.weight'"):
    TensorSource.open(d)
  save_file({"a.weight": w8}, str(d / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"'a\.weight' has dtype F8_E4M3.*without its scale"):
    TensorSource.open(d).check(["a.weight"])
  save_file({"a.weight_packed": np.zeros((4, 8), np.uint8)}, str(d / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"'a\.weight_packed' is NVFP4 but quantization_config declares "
                                            r"quant_method 'mxfp8'"):
    TensorSource.open(d)
  (d / "config.json").write_text(json.dumps({"quantization_config": FORMATS["nvfp4"]}))
  with pytest.raises(CheckpointError, match=r"NVFP4 weight 'a\.weight_packed' has no 'a\.weight_scale'"):
    TensorSource.open(d)
  packed, scale, g = q.quantize_nvfp4(np.ones((4, 16), np.float32))
  nv = {"a.weight_packed": packed, "a.weight_scale": scale}
  save_file(nv | {"a.weight_global_scale": g.astype(np.float16)}, str(d / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"NVFP4 global scale 'a\.weight_global_scale' must be F32, got F16"):
    TensorSource.open(d)
  save_file(nv | {"a.weight_global_scale": np.zeros(1, np.float32)}, str(d / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"'a\.weight_global_scale' must be one positive finite value to keep "
                                            r"'a\.weight' packed, got shape \[1\] \[0\.0\]"):
    TensorSource.open(d).get_global_scale("a.weight")


W1 = "language_model.model.layers.0.block_sparse_moe.experts.0.w1"


def _rewrite(path, edit) -> None:
  """Applies ``edit`` to the tensors of path/model.safetensors (a dict, edited in place) and writes them back."""
  file = str(path / "model.safetensors")
  tensors = {n: read_tensor(file, n) for n in SafetensorsDir(path).keys()}
  edit(tensors)
  save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("case", ["transposed", "widened", "float_scale", "bf16_scale", "missing"])
def test_mis_shaped_or_mis_typed_mxfp8_scales_are_refused(tmp_path, case):
  """#45: a transposed ([32, 2] -> [2, 32]) or widened scale used to convert silently under a guessed block;
  every scale must now have exactly the dtype and shape the declared format implies."""
  quantize_checkpoint(FLAT_B16, tmp_path / "q", "mxfp8")
  scale = W1 + ".weight_scale_inv"
  edits = {
      "transposed": lambda t: t.update({scale: np.ascontiguousarray(t[scale].T)}),
      "widened": lambda t: t.update({scale: np.concatenate([t[scale], t[scale][:, :1]], axis=1)}),
      "float_scale": lambda t: t.update({scale: t[scale].astype(np.float32)}),
      "bf16_scale": lambda t: t.update({scale: t[scale].astype(ml_dtypes.bfloat16)}),
      "missing": lambda t: t.pop(scale),
  }
  _rewrite(tmp_path / "q", edits[case])
  want = {
      "transposed": r"'[^']*w1\.weight_scale_inv' has shape \[2, 32\] but mxfp8 \(quant_method 'mxfp8', blocks of "
                    r"1x32\) implies \[32, 2\] for '[^']*w1\.weight' of shape \[32, 48\]",
      "widened": r"w1\.weight_scale_inv' has shape \[32, 3\] but mxfp8 .* implies \[32, 2\]",
      "float_scale": r"w1\.weight_scale_inv' has dtype F32; mxfp8 \(quant_method 'mxfp8'\) stores its scales as U8 or "
                     r"F8_E8M0",
      "bf16_scale": r"w1\.weight_scale_inv' has dtype BF16",
      "missing": r"w1\.weight' has dtype F8_E4M3.*without its scale",
  }[case]
  for attempt in (lambda: m3jax.load(tmp_path / "q"), lambda: convert(tmp_path / "q", tmp_path / "out", progress=False)):
    with pytest.raises(CheckpointError, match=want) as info:
      attempt()
    assert "\n" not in str(info.value)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("qc, want", [
    ({"quant_method": "awq"}, r"unknown quant_method 'awq'"),
    ({"ignored_layers": ["lm_head"]}, r"unknown quant_method None"),
    ({"quant_method": "mxfp8", "weight_block_size": [1, 16]}, r"mxfp8 has blocks of \[1, 32\]"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, r"compressed-tensors format 'int-quantized'"),
])
def test_unknown_quantization_configs_are_refused(tmp_path, qc, want):
  quantize_checkpoint(FLAT_B16, tmp_path / "q", "mxfp8")
  cfg_path = tmp_path / "q" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["quantization_config"] = qc
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"config\.json: quantization_config: " + want):
    m3jax.load(tmp_path / "q")


def test_declared_fp8_block_size_is_used_not_guessed(tmp_path):
  """The fp8 fixture declares 16 x 16 blocks; declaring 128 x 128 instead (which the stored [2, 3] grids of a
  [32, 48] weight do not fit) is an error naming the shapes, not a silent re-interpretation."""
  quantize_checkpoint(FLAT_B16, tmp_path / "q", "fp8_block")
  cfg_path = tmp_path / "q" / "config.json"
  cfg = json.loads(cfg_path.read_text())
  del cfg["quantization_config"]["weight_block_size"]
  cfg_path.write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"has shape \[\d+, \d+\] but fp8_block \(quant_method 'fp8', blocks of "
                                            r"128x128\) implies \[1, 1\]"):
    TensorSource.open(tmp_path / "q")
