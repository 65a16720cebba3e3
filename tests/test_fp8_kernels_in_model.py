"""A bf16 model with MXFP8 weights (``keep_quantized``'s in-memory form) on the Pallas kernels against the same
model on the references (issue #47): every fp8 op -- the fused decode projections, each projection at prefill,
o_proj, the dense MLP, the MoE block -- runs its fp8 kernel (interpret mode on CPU, compiled on an sm90 GPU), none
falls back, and the logits and greedy tokens match.

Dims are the smallest the fp8 kernels take (every weight's rows and columns multiples of 128: the committed MXFP8
fixture's hidden size 64 is not, so the model is random): hidden 128, 4 query heads and 2 KV heads of 64, index
heads 2 x 128, expert / shared / dense widths 128. A 72-token prompt runs the prefill tiles (T > 64), the decode
steps the decode tiles.
"""

import collections
import logging
import pathlib
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent / "kernels"))
import kernel_modes  # noqa: E402  pylint: disable=g-import-not-at-top
import m3jax
from m3jax.config import M3Config, TextConfig
from m3jax.generate import generate
from m3jax.layers.fused_quantized import FusedQuantizedWeights
from m3jax.layers.quantized import quantize_all
from m3jax.ops import dispatch

MODES = kernel_modes.MODES
FP8_KERNELS = {"quantized_matmul", "quantized_gated_mlp", "moe_block"}


def _config() -> M3Config:
  text = TextConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                    intermediate_size=128, dense_intermediate_size=128, shared_intermediate_size=128,
                    num_experts=4, num_experts_per_tok=2, attention_types=("full", "sparse"),
                    mlp_types=("dense", "moe"), index_num_heads=2, index_head_dim=128, index_block_size=128,
                    index_topk_blocks=2, index_local_blocks=1)
  return M3Config(text=text)


def _models(kernels: str) -> tuple[m3jax.M3ForCausalLM, m3jax.M3ForCausalLM]:
  """(the MXFP8 model on ``kernels``, the same weights on the references)."""
  cfg = _config()
  abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16))
  specs = quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(abstract))])
  reference = m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="reference", rngs=nnx.Rngs(0), quantized=specs)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels=kernels,
                                                                     quantized=specs)))
  return nnx.merge(graphdef, nnx.state(reference)), reference


class _KernelCalls:
  """Counts the kernels ``run_op`` finds, by name (wraps ``dispatch._find_kernel``)."""

  def __init__(self, monkeypatch):
    self.calls: collections.Counter = collections.Counter()
    find = dispatch._find_kernel

    def counting(module, name):
      kernel = find(module, name)
      if kernel is None:
        return None

      def call(*args, **kwargs):
        self.calls[name] += 1
        return kernel(*args, **kwargs)
      return call

    monkeypatch.setattr(dispatch, "_find_kernel", counting)
    monkeypatch.setattr(dispatch, "_seen", set())  # every fallback is logged again in this test


def _fallbacks(caplog) -> list[str]:
  return [r.message for r in caplog.records if "falls back" in r.message or "no Pallas kernel" in r.message
          or "cannot run kernels" in r.message]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mxfp8_model_on_kernels_matches_the_reference(mode, monkeypatch, caplog):
  kernels, reference = _models("pallas")
  calls = _KernelCalls(monkeypatch)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 256, (1, 72)), jnp.int32)
  with caplog.at_level(logging.WARNING, logger="m3jax.ops"):
    got = np.asarray(kernels(ids), np.float32)
    prompts = [rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 20).tolist()]  # ragged
    out = generate(kernels, prompts, max_new_tokens=3, eos_token_ids=())
  assert not _fallbacks(caplog), _fallbacks(caplog)
  assert FP8_KERNELS <= set(calls.calls), calls.calls
  want = np.asarray(reference(ids), np.float32)
  # Same weights, same arithmetic up to the order of fp32 additions and where bf16 rounding happens.
  per_token = np.abs(got - want).max(-1) / np.abs(want).max()
  assert np.median(per_token) < 5e-3 and per_token.max() < 2e-2, np.sort(per_token)[-5:]
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95
  # The decode loop projected with the fused fp8 q / k / v (/ index) weights (generate builds decode_weights).
  assert all(isinstance(d.projection, FusedQuantizedWeights) for d in kernels.decode_weights())
  expected = generate(reference, prompts, max_new_tokens=3, eos_token_ids=())
  np.testing.assert_array_equal(out.tokens, expected.tokens)


@pytest.mark.quick
def test_mxfp8_model_steps_lower_to_fp8_kernels(monkeypatch):
  """A decode step (with the fused decode weights) and a prefill of the MXFP8 model at one GPU's 8-way slice of M3
  (real widths, 1 dense + 3 sparse MoE layers) lower for CUDA with every fp8 weight read by an fp8 kernel: no
  fp8 value is converted (dequantized) outside a kernel."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from m3jax.config import m3_full  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)  # compiled kernels, as on a GPU backend
  text = dataclasses.replace(
      m3_full().text, num_layers=4, attention_types=("full",) + ("sparse",) * 3, mlp_types=("dense",) + ("moe",) * 3,
      num_heads=8, num_kv_heads=1, index_num_heads=1, intermediate_size=384, shared_intermediate_size=384,
      dense_intermediate_size=1536, vocab_size=25008)
  cfg = M3Config(text=text)
  abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16))
  specs = quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(abstract))])
  model = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas", quantized=specs))
  texts = kernel_modes.lowered_step_texts(model, decode_batch=4, prefill_batch=1, decode_weights=True)
  for name, text in texts.items():
    assert not re.search(r"stablehlo\.convert[^\n]*f8E4M3FN", text), f"{name}: fp8 weights dequantized by XLA"
    kinds = kernel_modes.lowered_kernel_kinds(text)
    assert kinds["attention"] == 2 and kinds["indexer"] == 1, (name, kinds)
    fp8 = set(re.findall(r"moe_grouped_fp8_mxfp8_(swiglu|none)_bm(\d+)_bn\d+_ks(\d+)", text))
    assert {e for e, _, _ in fp8} == {"swiglu", "none"}, (name, fp8)
    if name == "decode":  # token tiles of 8; the fused projections and the dense MLP split their reduction
      assert {int(bm) for _, bm, _ in fp8} == {8} and max(int(ks) for _, _, ks in fp8) > 1, fp8
    else:
      assert {int(bm) for _, bm, _ in fp8} == {128}, fp8


def test_nvfp4_experts_lower_to_the_w4a16_kernel(monkeypatch):
  """A model whose routed experts are kept as NVFP4 (``keep_quantized`` of an NVFP4 checkpoint: packed experts,
  everything else bf16) at M3's expert dims (whole experts, I = 3072, as m3jax's meshes place them): a decode step
  and a prefill lowered for CUDA read the packed experts with the W4A16 MoE kernel (M3JAX_KERNELS=pallas)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from m3jax.config import m3_full  # pylint: disable=g-import-not-at-top
  from m3jax.layers.quantized import QuantSpec  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)  # compiled kernels, as on a GPU backend
  text = dataclasses.replace(
      m3_full().text, num_layers=1, attention_types=("full",), mlp_types=("moe",), num_heads=8, num_kv_heads=1,
      index_num_heads=1, vocab_size=25008)
  cfg = M3Config(text=text)
  nvfp4 = lambda parts: QuantSpec("nvfp4", (1, 16), "float8_e4m3fn", (1, 16), parts)
  specs = {("layers", 0, "mlp", "w_gate_up"): nvfp4(2), ("layers", 0, "mlp", "w_down"): nvfp4(1)}
  model = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas", quantized=specs))
  texts = kernel_modes.lowered_step_texts(model, decode_batch=4, prefill_batch=1)
  for name, text in texts.items():
    w4 = set(re.findall(r"moe_grouped_w4a16_nvfp4_(swiglu|none)_bm(\d+)", text))
    assert {e for e, _ in w4} == {"swiglu", "none"}, (name, w4)
    assert {int(bm) for _, bm in w4} == ({8} if name == "decode" else {64}), (name, w4)
