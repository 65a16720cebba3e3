"""Weights kept in fp8 (#47): the QuantizedWeight helpers and references, the model with QuantizedLinear weights,
and the HF-built MXFP8 / FP8-block fixtures (scripts/make_hf_quantized_fixtures.py) loaded, converted and exported
without dequantizing."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import m3jax
from conftest import FIXTURES
from m3jax import cli
from m3jax.checkpoint import quantized as q
from m3jax.checkpoint.convert import convert
from m3jax.checkpoint.export import export
from m3jax.checkpoint.safetensors_dir import CheckpointError, SafetensorsDir
from m3jax.checkpoint.safetensors_stream import read_tensor
from m3jax.generate import generate
from m3jax.layers.fused_quantized import FusedQuantizedWeights
from m3jax.layers.quantized import QuantizedLinear, quantize_all
from pallas_kernels import quant
from pallas_kernels.linear.reference import quantized_matmul_reference
from pallas_kernels.moe import api as moe_api
from pallas_kernels.moe.reference import gated_mlp, moe_block_reference

FP8_FIXTURES = ["mxfp8_b128", "fp8block_b128"]
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def relative_error(got, ref) -> float:
  return float(np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref)))


def flat_params(model) -> dict:
  return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  return np.array_equal(a.view(np.uint8), b.view(np.uint8)) if a.dtype.itemsize == 1 else np.array_equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# pallas_kernels.quant helpers and the references


@pytest.mark.quick
def test_jnp_and_numpy_quantizers_agree_and_concat_split_invert():
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((3, 40, 80)) * rng.uniform(1e-3, 1e3, size=(3, 40, 1))).astype(np.float32)
  w[0, 0, :32] = 448.0 * 4  # amax exactly 448 * 2^k: the scale is 2^k, not 2^(k+1)
  values, scales = q.quantize_mxfp8(w)
  jq = quant.quantize(jnp.asarray(w), "mxfp8")
  assert same_bits(jq.values, values) and same_bits(jq.scales, scales) and scales[0, 0, 0] == 127 + 2
  np.testing.assert_array_equal(np.asarray(quant.dequantize(jq)), q.dequantize_blocked(values, scales, (1, 32)))
  # fp8_block 128 x 128 parts of 32 and 200 rows concatenated along out: scale rows re-blocked to gcd(128, 32).
  parts = [quant.quantize(jnp.asarray(rng.standard_normal((n, 300)), jnp.float32), "fp8_block") for n in (32, 200)]
  values, scales, block = quant.concat_out([(p.values, p.scales) for p in parts], "fp8_block", (128, 128))
  assert block == (32, 128) and scales.shape == (1 + 7, 3)
  whole = quant.QuantizedWeight(values, scales, "fp8_block", block)
  np.testing.assert_array_equal(np.asarray(whole.dequantize()),
                                np.concatenate([np.asarray(p.dequantize()) for p in parts]))
  back = quant.split_out(values, scales, [32, 200], block, (128, 128))
  for (v, s), p in zip(back, parts):
    assert same_bits(v, p.values) and same_bits(s, p.scales)
  assert quant.concat_block([256, 256], "fp8_block", (128, 128)) == (128, 128)  # aligned: unchanged


@pytest.mark.quick
def test_references_take_quantized_weights():
  rng = np.random.default_rng(1)
  e, h, i, t = 4, 64, 32, 6
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  router = jnp.asarray(rng.standard_normal((h, e)) * 0.1, jnp.float32)
  bias = jnp.zeros((e,), jnp.float32)
  # Quantized in the checkpoint orientation [.., out, in]; the dense references get the same weights [.., in, out].
  qs = [quant.quantize(jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32), fmt) for s, fmt in
        (((e, 2 * i, h), "mxfp8"), ((e, h, i), "mxfp8"), ((2 * i, h), "fp8_block"), ((h, i), "mxfp8"))]
  dense = [jnp.swapaxes(w.dequantize(), -1, -2) for w in qs]
  kw = dict(top_k=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
  want = moe_block_reference(x, router, bias, *dense, **kw)
  got = moe_block_reference(x, router, bias, *qs, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(gated_mlp(x, qs[2], qs[3], alpha=1.702, limit=7.0)),
                                np.asarray(gated_mlp(x, dense[2], dense[3], alpha=1.702, limit=7.0)))
  xb = x.astype(jnp.bfloat16)
  y = quantized_matmul_reference(xb, qs[2])  # [2I, H] = [out, in]
  assert y.dtype == jnp.bfloat16 and y.shape == (t, 2 * i)
  want = jnp.dot(xb, dense[2].astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  # The fp8 kernels run bf16 activations only: with fp32 ones they refuse (run_op then takes the reference).
  with pytest.raises(NotImplementedError, match="fp8"):
    moe_api.moe_block(x, router, bias, *qs, **kw, interpret=True)
  with pytest.raises(NotImplementedError, match="fp8|bf16"):
    moe_api.routed_experts(x, jnp.ones((t, 2)), jnp.zeros((t, 2), jnp.int32), qs[0], qs[1], alpha=1.7, limit=7.0,
                           interpret=True)


# ----------------------------------------------------------------------------------------------------------
# The model with QuantizedLinear weights (random, MTP included)


def _dequantized_twin(model: m3jax.M3ForCausalLM, cfg, **kwargs) -> m3jax.M3ForCausalLM:
  """A float model whose every weight equals ``model``'s (fp8 ones dequantized into m3jax's layout)."""
  twin = m3jax.M3ForCausalLM(cfg, dtype=model.dtype, kernels="reference", **kwargs)
  for path, var in nnx.to_flat_state(nnx.state(twin, nnx.Param)):
    node = model
    for key in path[:-1]:
      node = node[key] if isinstance(key, int) else getattr(node, key)
    src = getattr(node, path[-1])
    if isinstance(src, QuantizedLinear):
      w = np.asarray(src.weight().dequantize(jnp.float32))
      value = np.swapaxes(w, -1, -2).reshape(var.shape)
    else:
      value = np.asarray(src.get_value())
    var.set_value(jnp.asarray(value, var.dtype))
  return twin


def test_random_quantized_model_with_mtp_equals_its_dequantized_twin():
  cfg = m3jax.tiny(mtp=True)
  abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.float32, with_mtp=True))
  specs = quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(abstract))])
  assert ("mtp", 0, "layer", "mlp", "w_gate_up") in specs and not any(p[-1] in ("router", "eh_proj") for p in specs)
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0), with_mtp=True,
                              quantized=specs)
  state = {"/".join(map(str, p)): v for p, v in flat_params(model).items()}
  assert state["layers/1/mlp/w_gate_up/values"].dtype == F8 and state["layers/1/mlp/w_gate_up/values"].shape == (
      cfg.text.num_experts, 2 * cfg.text.intermediate_size, cfg.text.hidden_size)
  assert state["layers/0/attn/o_proj/scales"].dtype == np.uint8
  twin = _dequantized_twin(model, cfg, with_mtp=True)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.text.vocab_size, (2, 24)), jnp.int32)

  @nnx.jit
  def run(m, ids):  # the backbone, then one MTP draft step on its hidden states (with the MTP decode weights)
    out = m.forward(ids)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    mtp = m.mtp_forward(jnp.roll(ids, -1, axis=1), out.hidden, positions=pos, decode_weights=m.mtp_decode_weights())
    return out.logits, mtp.logits

  (got, got_mtp), (want, want_mtp) = run(model, ids), run(twin, ids)
  pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
  assert relative_error(got, np.asarray(want)) <= 1e-6
  assert relative_error(got_mtp, np.asarray(want_mtp)) <= 1e-6
  # Decode weights for a loop: the fp8 q / k / v (/ index q / k) stacked into one fp8 weight with their scales,
  # fp8 experts need no prepared operands.
  prepared = model.decode_weights()
  assert all(isinstance(d.projection, FusedQuantizedWeights) and d.experts is None for d in prepared)
  t = cfg.text
  sparse = cfg.text.attention_types.index("sparse")
  fused = prepared[sparse].projection
  assert fused.out_shapes == ((t.num_heads, t.head_dim), (t.num_kv_heads, t.head_dim), (t.num_kv_heads, t.head_dim),
                              (t.index_num_heads, t.index_head_dim), (1, t.index_head_dim))
  attn = model.layers[sparse].attn
  parts = [attn.q_proj, attn.k_proj, attn.v_proj, attn.indexer.q_proj, attn.indexer.k_proj]
  assert same_bits(fused.weight.values, np.concatenate([np.asarray(p.values[...]) for p in parts]))
  assert same_bits(fused.weight.scales, np.concatenate([np.asarray(p.scales[...]) for p in parts]))

  # A decode step with the fused projections equals one with each projection on its own.
  forward = nnx.jit(lambda m, i, p, c, d: m.forward(i, positions=p, caches=c, decode_weights=d))
  caches = forward(model, ids[:, :8], pos[:, :8], model.init_caches(2, 32), None).caches
  fused_logits = forward(model, ids[:, 8:9], pos[:, 8:9], caches, prepared).logits
  np.testing.assert_allclose(np.asarray(fused_logits), np.asarray(forward(model, ids[:, 8:9], pos[:, 8:9], caches,
                                                                          None).logits), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The HF fixtures


@pytest.fixture(scope="module")
def fp8_models():
  return {n: m3jax.load(FIXTURES / n / "checkpoint", kernels="reference", keep_quantized=True) for n in FP8_FIXTURES}


def _logits_at(model, ref) -> np.ndarray:
  return np.asarray(model(ref["input_ids"]))[:, ref["logit_positions"]]


def _prompts(ref) -> list[list[int]]:
  return [ref["input_ids"][b, : ref["gen_prompt_lens"][b]].tolist() for b in range(len(ref["gen_prompt_lens"]))]


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fixture_kept_in_fp8_matches_hf(fp8_models, name):
  ref = np.load(FIXTURES / name / "reference.npz")
  meta = json.loads((FIXTURES / name / "meta.json").read_text())
  model = fp8_models[name]
  assert model.dtype == jnp.float32
  state = {"/".join(map(str, p)): v for p, v in flat_params(model).items()}
  fmt = meta["format"]
  moe = next(i for i, t in enumerate(model.config.text.mlp_types) if t == "moe")
  for weight in (f"layers/{moe}/mlp/w_gate_up", f"layers/{moe}/mlp/w_down", f"layers/{moe}/mlp/shared/gate_up",
                 f"layers/{moe}/mlp/shared/down", "layers/0/attn/q_proj", "layers/0/attn/o_proj"):
    assert state[weight + "/values"].dtype == F8, weight
    assert state[weight + "/scales"].dtype == (np.uint8 if fmt == "mxfp8" else np.float32), weight
    assert getattr(model.layers[int(weight.split("/")[1])], "attn").q_proj.fmt == fmt
  assert state[f"layers/{moe}/mlp/router"].dtype == np.float32 and state["lm_head"].dtype == np.float32
  assert all(v.dtype == np.float32 for k, v in state.items() if k.startswith("vision/"))
  # Every fp8 byte of the checkpoint is in the model as stored; the scales too (fp8_block: 128-row scales repeated
  # where gate / up halves of 32 or 96 rows end inside a block, so a few more of them).
  ckpt = SafetensorsDir(FIXTURES / name / "checkpoint")
  stored = {d: sum(int(np.prod(ckpt.shape(n))) * np.dtype(np.float32 if d == "F32" else np.uint8).itemsize
                   for n in ckpt.keys() if ckpt.dtype(n) == d and (d == "F8_E4M3" or n.endswith("_scale_inv")))
            for d in ("F8_E4M3", "U8", "F32")}
  values = sum(v.nbytes for k, v in state.items() if k.endswith("/values"))
  scales = sum(v.nbytes for k, v in state.items() if k.endswith("/scales"))
  assert values == stored["F8_E4M3"] and values + stored["U8"] + stored["F32"] == meta["quantized_bytes"][
      "fp8_values_and_scales"]
  assert scales == stored["U8"] if fmt == "mxfp8" else stored["F32"] < scales < 2 * stored["F32"]
  assert relative_error(_logits_at(model, ref), ref["logits"]) <= 1e-5


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fixture_greedy_equals_hf_forward_greedy(fp8_models, name):
  ref = np.load(FIXTURES / name / "reference.npz")
  out = generate(fp8_models[name], _prompts(ref), max_new_tokens=ref["gen_tokens"].shape[1], eos_token_ids=())
  np.testing.assert_array_equal(out.tokens, ref["gen_tokens"])


def test_convert_keep_quantized_then_export_round_trip(fp8_models, tmp_path):
  """fp8 fixture -> convert --keep-quantized (pieces of a few experts) -> load (same params bit for bit, HF
  logits and greedy tokens) -> export: every tensor of the source back bit for bit, with its quantization_config."""
  name = "fp8block_b128"  # 128 x 128 blocks over 32-row gate / up halves: scale rows re-blocked, and back
  src = FIXTURES / name / "checkpoint"
  # Pieces of a few KB (the CLI's --piece-mb is at least 1 MiB, a whole tensor of this fixture).
  convert(src, tmp_path / "c", keep_quantized=True, max_piece_bytes=4096, progress=False)
  marker = json.loads((tmp_path / "c" / "m3jax_checkpoint.json").read_text())
  assert marker["quantized"]["quantization_config"]["quant_method"] == "fp8"
  spec = marker["quantized"]["params"]["layers/0/mlp/w_gate_up"]
  assert spec["block"] == [32, 128] and spec["source_block"] == [128, 128] and spec["scale_dtype"] == "float32"
  model = m3jax.load(tmp_path / "c", kernels="reference")
  a, b = flat_params(model), flat_params(fp8_models[name])
  assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
  ref = np.load(FIXTURES / name / "reference.npz")
  assert relative_error(_logits_at(model, ref), ref["logits"]) <= 1e-5
  prompt = _prompts(ref)[:1]
  np.testing.assert_array_equal(generate(model, prompt, max_new_tokens=8, eos_token_ids=()).tokens,
                                ref["gen_tokens"][:1, :8])
  summary = export(tmp_path / "c", tmp_path / "e", progress=False, max_piece_bytes=1)
  exported, source = SafetensorsDir(tmp_path / "e"), SafetensorsDir(src)
  assert set(exported.keys()) == set(source.keys()) and summary.tensors == len(source.keys())
  for n in source.keys():
    got, want = read_tensor(str(tmp_path / "e" / exported.file_of(n)), n), read_tensor(str(src / source.file_of(n)), n)
    if source.dtype(n) in ("F8_E4M3", "F32") and (n.endswith("_scale_inv") or source.dtype(n) == "F8_E4M3"):
      assert same_bits(got, want), n  # fp8 values and their scales: the stored bytes
    else:  # float tensors: the same values in the conversion's dtype (fp32; the vision tower is stored in bf16)
      np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=n)
  qc = json.loads((tmp_path / "e" / "config.json").read_text())["quantization_config"]
  assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
  reloaded = m3jax.load(tmp_path / "e", kernels="reference", keep_quantized=True)
  c = flat_params(reloaded)
  assert all(same_bits(c[k], b[k]) for k in b)


def test_quantize_mxfp8_round_trip(tmp_path):
  """A float checkpoint quantized on conversion: its fp8 weights are the reference quantizer's (those of
  test_quantized.quantize_checkpoint, bit for bit), the logits equal the float model of the dequantized weights,
  and the export loads back (our loader's exact checks) into the same weights."""
  from test_quantized import FLAT_B16, quantize_checkpoint, write_plain  # pylint: disable=g-import-not-at-top

  summary = convert(FLAT_B16, tmp_path / "c", quantize="mxfp8", progress=False)
  assert summary.kept_fp8 == {"mxfp8": 20} and "quantized into mxfp8" in "\n".join(summary.lines())
  dequantized = quantize_checkpoint(FLAT_B16, tmp_path / "q", "mxfp8")
  write_plain(dequantized, FLAT_B16, tmp_path / "plain")
  model = m3jax.load(tmp_path / "c", kernels="reference")
  direct = m3jax.load(tmp_path / "q", kernels="reference", keep_quantized=True)
  a, b = flat_params(model), flat_params(direct)
  assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
  assert a[("layers", 0, "attn", "indexer", "k_proj", "values")].dtype == F8
  ids = np.load(FIXTURES / "flat_b16" / "reference.npz")["input_ids"][:, :64]
  want = np.asarray(m3jax.load(tmp_path / "plain", kernels="reference")(ids))
  assert relative_error(model(ids), want) <= 1e-5
  export(tmp_path / "c", tmp_path / "e", progress=False)
  cfg = json.loads((tmp_path / "e" / "config.json").read_text())
  assert cfg["quantization_config"]["quant_method"] == "mxfp8"
  c = flat_params(m3jax.load(tmp_path / "e", kernels="reference", keep_quantized=True))
  assert all(same_bits(c[k], a[k]) for k in a)


@pytest.mark.quick
def test_quantize_refuses_a_quantized_source_and_writes_nothing(tmp_path, capsys):
  src = FIXTURES / "mxfp8_b128" / "checkpoint"
  with pytest.raises(CheckpointError, match=r"--quantize mxfp8: the checkpoint is already quantized \(quant_method "
                                            r"'mxfp8'\); use --keep-quantized"):
    convert(src, tmp_path / "out", quantize="mxfp8", progress=False)
  assert cli.main(["convert", str(src), str(tmp_path / "out"), "--quantize", "mxfp8", "--no-progress"]) == 2
  assert "already quantized" in capsys.readouterr().err
  assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_inspect_plans_fp8_bytes_per_device(capsys):
  ckpt = str(FIXTURES / "mxfp8_b128" / "checkpoint")
  assert cli.main(["inspect", ckpt, "--mesh", "expert=4,tensor=2", "--keep-quantized", "--context", "512"]) == 0
  out = capsys.readouterr().out
  assert "linear weights kept in fp8 (mxfp8)" in out
  from m3jax.checkpoint.inspect import fp8_specs  # pylint: disable=g-import-not-at-top
  from m3jax.parallel.memory import plan_memory  # pylint: disable=g-import-not-at-top

  cfg = m3jax.M3Config.from_file(ckpt)
  kept = plan_memory(cfg, "expert=4,tensor=2", batch=1, context=512, dtype=jnp.float32, quantized=fp8_specs(ckpt))
  plain = plan_memory(cfg, "expert=4,tensor=2", batch=1, context=512, dtype=jnp.float32)
  t = cfg.text
  experts = 2 * t.num_experts * 3 * t.intermediate_size * t.hidden_size  # 2 MoE layers
  scales = experts // 32
  assert kept.weights["routed experts"] == (experts + scales) // 8  # whole experts, 8-way
  assert plain.weights["routed experts"] == 4 * experts // 8
  assert kept.decode_workspace == 0 < plain.decode_workspace  # no fused projections, no fp32 split for fp8
  # On one device the fp8 q / k / v (/ index q / k) are fused for decode: their values and scales once more.
  one = plan_memory(cfg, "data=1", batch=1, context=512, dtype=jnp.float32, quantized=fp8_specs(ckpt))
  rows = sum(t.num_heads * t.head_dim + 2 * t.num_kv_heads * t.head_dim
             + ((t.index_num_heads + 1) * t.index_head_dim if kind == "sparse" else 0) for kind in t.attention_types)
  assert one.fused_projections == rows * (t.hidden_size + t.hidden_size // 32) and one.split_experts == 0


def test_bf16_activations_with_fp8_weights():
  """dtype='bfloat16' with weights kept in fp8: the fp8 values and scales stay as stored (MXFP8 dequantizes exactly
  into bf16), other weights are bf16 (routers fp32); the logits are as close to HF's fp32 ones as those of the
  bf16 model of the dequantized weights (this tiny random model's bf16 logits are noisy: its router gaps are
  ~1e-4, so both lie ~0.3 of the largest logit away at worst; the greedy choices agree)."""
  name = "mxfp8_b128"
  ref = np.load(FIXTURES / name / "reference.npz")
  kept = m3jax.load(FIXTURES / name / "checkpoint", kernels="reference", keep_quantized=True, dtype="bfloat16")
  plain = m3jax.load(FIXTURES / name / "checkpoint", kernels="reference", dtype="bfloat16")
  state = {"/".join(map(str, p)): v for p, v in flat_params(kept).items()}
  assert state["layers/1/mlp/w_gate_up/values"].dtype == F8 and state["layers/1/mlp/w_gate_up/scales"].dtype == np.uint8
  assert state["layers/1/mlp/router"].dtype == np.float32 and state["embed"].dtype == jnp.bfloat16
  got, base = _logits_at(kept, ref), _logits_at(plain, ref)
  assert relative_error(got, ref["logits"]) <= 1.25 * relative_error(base, ref["logits"]) + 1e-3
  assert (got.argmax(-1) == ref["logits"].argmax(-1)).mean() >= 0.95


def test_generate_fuses_the_fp8_projections_once_outside_the_decode_loop():
  """generate builds the fused fp8 q / k / v (/ index) weights (values and scales) before its decode loop, once:
  the loop body concatenates no fp8 weights (XLA:GPU keeps a concatenation written in the loop in the loop)."""
  from m3jax.generate import _generate_jit  # pylint: disable=g-import-not-at-top
  from m3jax.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  from program_walk import concatenates  # pylint: disable=g-import-not-at-top

  cfg = m3jax.tiny()
  t = cfg.text
  abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.float32))
  specs = quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(abstract))])
  model = m3jax.M3ForCausalLM(cfg, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0), quantized=specs)
  graphdef, state = nnx.split(model)
  args = (graphdef, state, jnp.ones((2, 16), jnp.int32), jnp.asarray([16, 12], jnp.int32), jax.random.key(0),
          jnp.asarray([2], jnp.int32), jnp.int32(0), None, jnp.int32(4))
  jaxpr = _generate_jit.trace(*args, width=32, sampling=SamplingParams(), cache_len=128).jaxpr.jaxpr
  found = concatenates(jaxpr, lambda aval: aval.dtype == jnp.float8_e4m3fn and aval.shape[-1] == t.hidden_size)
  qkv = (t.num_heads + 2 * t.num_kv_heads) * t.head_dim
  rows = sorted(qkv + (t.index_num_heads + 1) * t.index_head_dim * (kind == "sparse") for kind in t.attention_types)
  assert not [a.shape for a, inside in found if inside], "fp8 projection weights concatenated in the decode loop"
  assert sorted(a.shape[0] for a, _ in found) == rows  # once per layer, before the loop (the prefill: no fusion)
