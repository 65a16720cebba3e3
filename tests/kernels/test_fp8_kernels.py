"""fp8 (``QuantizedWeight``) kernels against dequantize + the bf16 references: the MoE block, routed experts and
``pallas_kernels.linear.quantized_matmul``.

CPU: the Mosaic-GPU interpreter on tiny dims (mxfp8 at K % 128, fp8_block at K % 512). The interpreter runs the
kernels' jnp twin of the in-register dequantization (``pallas_kernels._fp8_tiles``); the PTX version's bit
arithmetic is emulated in numpy over every e4m3 byte and code, and runs for real in the ``gpu`` modes (sm90),
where an identity matmul must return the dequantized weight bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernel_modes
from pallas_kernels import _fp8_tiles
from pallas_kernels.linear import heuristic_linear_tiles, quantized_matmul
from pallas_kernels.moe import moe_block, moe_block_reference, route_reference, routed_experts, routed_experts_reference
from pallas_kernels.moe.kernel_sm90_fp8 import Fp8Tiles
from pallas_kernels.quant import KERNEL_MAX_E8M0, QuantizedWeight, dequantize, kernel_scale_range_ok

MODES = kernel_modes.MODES
_KW = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
_BLOCK = {"mxfp8": (1, 32), "fp8_block": (128, 128)}


def _quantize_2d(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
  """fp32 [out, in] (in % 32 == 0; fp8_block: both % 128) -> (e4m3 values, scales), round to nearest: mxfp8
  codes 2^ceil(log2(amax / 448)) per 32 inputs, fp8_block fp32 amax / 448 per 128 x 128 block (the checkpoint
  quantizers' rules, restated here so the kernel tests import no model code)."""
  out, inp = w.shape
  if fmt == "mxfp8":
    amax = np.abs(w.reshape(out, inp // 32, 32)).max(-1)
    exp = np.clip(np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 448.0)), 0), -127, 127)
    q = w / np.repeat(np.ldexp(1.0, exp.astype(np.int32)), 32, axis=1)
    return q.astype(ml_dtypes.float8_e4m3fn), (exp + 127).astype(np.uint8)
  amax = np.abs(w.reshape(out // 128, 128, inp // 128, 128)).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
  return (w / np.repeat(np.repeat(scale, 128, 0), 128, 1)).astype(ml_dtypes.float8_e4m3fn), scale


def _quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
  """fp32 [..., out, in] -> QuantizedWeight, per 2D slice."""
  flat = w.reshape(-1, *w.shape[-2:]).astype(np.float32)
  vals, scales = zip(*(_quantize_2d(m, fmt) for m in flat))
  lead = w.shape[:-2]
  return QuantizedWeight(jnp.asarray(np.stack(vals).reshape(*lead, *vals[0].shape)),
                         jnp.asarray(np.stack(scales).reshape(*lead, *scales[0].shape)), fmt, _BLOCK[fmt])


def _bf16(w: QuantizedWeight) -> jax.Array:
  """The dequantized weight in the bf16 kernels' [in, out] layout."""
  return jnp.swapaxes(dequantize(w, jnp.bfloat16), -1, -2)


@functools.cache
def _moe_inputs(t, h, inter, e, shared_inter, fmt, seed=0, shared_fmt=None):
  """x bf16 [T, H], router, bias, and the experts / shared expert quantized in the checkpoint orientation."""
  rng = np.random.default_rng(seed)
  nrm = lambda shape, scale: rng.normal(size=shape).astype(np.float32) * scale
  x = jnp.asarray(nrm((t, h), 1.0), jnp.bfloat16)
  router_w, bias = jnp.asarray(nrm((h, e), h ** -0.5)), jnp.asarray(nrm((e,), 0.1))
  gu, dn = _quantize(nrm((e, 2 * inter, h), 3 * h ** -0.5), fmt), _quantize(nrm((e, h, inter), inter ** -0.5), fmt)
  sgu_f, sdn_f = nrm((2 * shared_inter, h), 3 * h ** -0.5), nrm((h, shared_inter), shared_inter ** -0.5)
  if shared_fmt == "bf16":
    sgu, sdn = jnp.asarray(sgu_f.T, jnp.bfloat16), jnp.asarray(sdn_f.T, jnp.bfloat16)
  else:
    sgu, sdn = _quantize(sgu_f, shared_fmt or fmt), _quantize(sdn_f, shared_fmt or fmt)
  return x, router_w, bias, gu, dn, sgu, sdn


def _reference(args, top_k):
  x, router_w, bias, gu, dn, sgu, sdn = args
  deq = lambda w: _bf16(w) if isinstance(w, QuantizedWeight) else w
  return moe_block_reference(x, router_w, bias, deq(gu), deq(dn), deq(sgu), deq(sdn), top_k=top_k, **_KW)


def _assert_close(out, ref, reduce_len):
  """bf16 outputs: the same bf16 weights and fp32 accumulation as the reference, so only rounding differs."""
  out, ref = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
  assert out.shape == ref.shape and np.isfinite(out).all()
  tol = 2e-2 * max(1.0, np.sqrt(reduce_len / 128))
  np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# The dequantization arithmetic (no kernel)


def _emulate_mx_pair_ptx(byte: np.ndarray, code: np.ndarray) -> np.ndarray:
  """numpy (IEEE, no flushing) of ``_fp8_tiles._MX_PAIR_PTX`` / ``_MX_SCALE_PTX`` on one e4m3 byte and one E8M0 code
  -> float64 of the bf16 result."""
  t = byte.astype(np.uint32) << 8  # the byte in the high half of a 16-bit lane (prmt 0x1404)
  m = (t >> 4) & 0x07F0
  bits = (t & 0x8000) | m  # lop3 0xEC
  moved = (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)  # e4m3 * 2^-120, as a bf16
  scale_bits = ((code.astype(np.uint32) + 120) << 7) << 16  # (s + 120) << 7: bf16 2^(s - 7)
  scale = scale_bits.astype(np.uint32).view(np.float32).astype(np.float64)
  return (moved * scale).astype(ml_dtypes.bfloat16).astype(np.float64)  # mul.rn.bf16x2: one rounding


def test_mx_pair_ptx_arithmetic_is_exact():
  # Every e4m3 byte (NaN excepted) under every code the kernels take: the PTX bit moves and the bf16 multiply
  # give e4m3 * 2^(s - 127) rounded once to bf16 (subnormal e4m3 and subnormal bf16 results included).
  byte = np.arange(256, dtype=np.uint8)
  e4m3 = byte.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  ok = ~np.isnan(e4m3)
  codes = np.arange(KERNEL_MAX_E8M0 + 1, dtype=np.uint8)
  got = _emulate_mx_pair_ptx(byte[ok][None, :], codes[:, None])
  want = (e4m3[ok][None, :] * np.ldexp(1.0, codes.astype(np.int64)[:, None] - 127)).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(got, want.astype(np.float64))


@pytest.mark.quick
def test_mx_tile_dequant_twin_matches_dequantize():
  # The interpreter's twin computes dequantize's weights (codes from 10: XLA:CPU flushes fp32 subnormals).
  e4m3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
  e4m3 = e4m3[~np.isnan(e4m3.astype(np.float32))][:224]
  codes = np.array([10, 99, 113, 118, 127, 134], np.uint8)
  values = np.tile(e4m3, (len(codes), 1))
  w = QuantizedWeight(jnp.asarray(values), jnp.asarray(np.repeat(codes[:, None], 7, axis=1)), "mxfp8", (1, 32))
  got = _fp8_tiles.dequant_mx_jnp(w.values, w.scales)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(dequantize(w, jnp.bfloat16)))
  assert bool(kernel_scale_range_ok(w))


def test_block_tile_dequant_is_bit_exact():
  e4m3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
  e4m3 = jnp.asarray(e4m3[~np.isnan(e4m3.astype(np.float32))])
  for scale in (3.7e-4, 1.0 / 448, 0.0123, 1.5):
    got = _fp8_tiles.dequant_block_jnp(e4m3, jnp.float32(scale))
    want = (e4m3.astype(jnp.float32) * jnp.float32(scale)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_scale_range_check():
  w = QuantizedWeight(jnp.zeros((2, 64), jnp.float8_e4m3fn), jnp.full((2, 2), 135, jnp.uint8), "mxfp8", (1, 32))
  assert not bool(kernel_scale_range_ok(w))


# ---------------------------------------------------------------------------------------------------------------
# MoE block / routed experts

# (name, T, H, I, E, Is, fmt, shared format, top_k, tiles): decode (broadcast layout, T rounded up to 8 token
# rows), the grouped (prefill) dispatch on small token tiles, an unfused wider shared expert, a bf16 shared expert
# beside quantized experts, and fp8_block (K % 512).
_DECODE = None
_GROUPED = (Fp8Tiles(block_m=16, max_concurrent_steps=2), Fp8Tiles(block_m=16, max_concurrent_steps=2, row_tiles=2))
CASES = [
    ("decode_1_token", 1, 256, 128, 8, 128, "mxfp8", None, 2, _DECODE),
    ("decode_5_tokens_wide_shared", 5, 256, 128, 4, 256, "mxfp8", None, 2, _DECODE),
    ("grouped_37_tokens", 37, 256, 128, 4, 128, "mxfp8", None, 2, _GROUPED),
    ("bf16_shared_expert", 3, 256, 128, 4, 128, "mxfp8", "bf16", 2, _DECODE),
    ("fp8_block_decode", 3, 512, 512, 4, 512, "fp8_block", None, 2, _DECODE),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,t,h,inter,e,shared_inter,fmt,shared_fmt,top_k,tiles", CASES, ids=[c[0] for c in CASES])
def test_fp8_moe_block_matches_reference(mode, name, t, h, inter, e, shared_inter, fmt, shared_fmt, top_k, tiles):
  args = _moe_inputs(t, h, inter, e, shared_inter, fmt, seed=len(name), shared_fmt=shared_fmt)
  out = moe_block(*args, top_k=top_k, **_KW, interpret=mode == "interpret", block_sizes=tiles)
  assert out.dtype == jnp.bfloat16
  _assert_close(out, _reference(args, top_k), h)


@pytest.mark.quick
@pytest.mark.parametrize("mode", MODES)
def test_fp8_routed_experts_on_a_slice_of_experts(mode):
  # Experts [2, 4) of 4 held here (expert parallelism), first_expert traced as under shard_map.
  x, router_w, bias, gu, dn, _, _ = _moe_inputs(9, 256, 128, 4, 128, "mxfp8", seed=11)
  weights, ids, _ = route_reference(x, router_w, bias, top_k=2)
  held = lambda w: QuantizedWeight(w.values[2:], w.scales[2:], w.fmt, w.block)
  kw = dict(alpha=_KW["swiglu_alpha"], limit=_KW["swiglu_limit"])
  run = jax.jit(lambda f: routed_experts(x, weights, ids, held(gu), held(dn), f, **kw, interpret=mode == "interpret"))
  out = np.asarray(run(jnp.int32(2)))
  ref = np.asarray(routed_experts_reference(x, weights, ids, _bf16(held(gu)), _bf16(held(dn)), 2, **kw))
  here = np.asarray((ids >= 2)).any(axis=1)
  assert here.any() and (~here).any()
  assert (out[~here] == 0).all()
  np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.quick
def test_fp8_moe_input_validation():
  x, router_w, bias, gu, dn, sgu, sdn = _moe_inputs(1, 256, 128, 8, 128, "mxfp8")
  with pytest.raises(NotImplementedError, match="bf16 activations"):
    moe_block(x.astype(jnp.float32), router_w, bias, gu, dn, sgu, sdn, top_k=2, **_KW, interpret=True)
  bad_dn = QuantizedWeight(dn.values[:, :128], dn.scales[:, :128], dn.fmt, dn.block)
  with pytest.raises(ValueError, match=r"w_down must be \[E=8, H=256, I=128\]"):
    moe_block(x, router_w, bias, gu, bad_dn, sgu, sdn, top_k=2, **_KW, interpret=True)
  with pytest.raises(ValueError, match="both be QuantizedWeight"):
    moe_block(x, router_w, bias, gu, _bf16(dn), sgu, sdn, top_k=2, **_KW, interpret=True)
  with pytest.raises(NotImplementedError, match="quantized shared expert beside"):
    moe_block(x, router_w, bias, _bf16(gu), _bf16(dn), sgu, sdn, top_k=2, **_KW, interpret=True)


# ---------------------------------------------------------------------------------------------------------------
# Dense projection


@functools.cache
def _linear_inputs(t, out_f, in_f, fmt, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(t, in_f)), jnp.bfloat16)
  return x, _quantize(rng.normal(size=(out_f, in_f)).astype(np.float32) * in_f ** -0.5, fmt)


# (name, T, out, in, fmt, tiles): decode with the heuristic (3 interpreter SMs: no split), decode with the
# reduction split across items and 256-feature items, an odd prefill token count (128-token tiles), fp8_block.
LINEAR_CASES = [
    ("decode_heuristic", 3, 256, 512, "mxfp8", None),
    ("decode_split_k", 5, 256, 1024, "mxfp8", Fp8Tiles(block_m=8, max_concurrent_steps=2, k_splits=2, row_tiles=2)),
    ("prefill_odd_tokens", 70, 128, 256, "mxfp8", None),
    ("fp8_block_decode", 2, 128, 512, "fp8_block", None),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,t,out_f,in_f,fmt,tiles", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_quantized_matmul_matches_reference(mode, name, t, out_f, in_f, fmt, tiles):
  x, w = _linear_inputs(t, out_f, in_f, fmt, seed=len(name))
  out = quantized_matmul(x, w, interpret=mode == "interpret", tiles=tiles)
  ref = jnp.dot(x, dequantize(w, jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  assert out.shape == (t, out_f) and out.dtype == jnp.bfloat16
  _assert_close(out, ref, in_f)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t,tiles", [(3, None), (5, Fp8Tiles(block_m=8, max_concurrent_steps=2, k_splits=2)),
                                     (70, None)], ids=["decode", "decode_split_k", "prefill"])
def test_quantized_matmul_fp32_output_is_the_unrounded_product(mode, t, tiles):
  """out_dtype=float32: the fp32 accumulators (or the fp32 sum of the split-K partials), not rounded to bf16."""
  x, w = _linear_inputs(t, 256, 1024, "mxfp8", seed=t)
  out = quantized_matmul(x, w, interpret=mode == "interpret", tiles=tiles, out_dtype=jnp.float32)
  ref = jnp.dot(x.astype(jnp.float32), dequantize(w, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
  assert out.dtype == jnp.float32 and out.shape == (t, 256)
  # fp32 accumulation of exact bf16 x exact weight products: only the order of the additions differs.
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
  bf16 = quantized_matmul(x, w, interpret=mode == "interpret", tiles=tiles)
  np.testing.assert_array_equal(np.asarray(bf16), np.asarray(out.astype(jnp.bfloat16)))


# (name, T, H, F): decode (split-K gate_up with fp32 output, SwiGLU in XLA, down), prefill (the grouped-GEMM pair
# with the SwiGLU epilogue), 256-wide down items (H % 256 == 0).
MLP_CASES = [("decode", 3, 256, 256), ("decode64", 64, 128, 128), ("prefill", 70, 256, 128)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,t,h,f", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_quantized_gated_mlp_matches_reference(mode, name, t, h, f):
  from pallas_kernels.linear import quantized_gated_mlp, quantized_gated_mlp_reference  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(len(name) + t)
  x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
  gu = _quantize(rng.normal(size=(2 * f, h)).astype(np.float32) * 3 * h ** -0.5, "mxfp8")
  dn = _quantize(rng.normal(size=(h, f)).astype(np.float32) * f ** -0.5, "mxfp8")
  kw = dict(alpha=1.702, limit=7.0)
  out = quantized_gated_mlp(x, gu, dn, **kw, interpret=mode == "interpret")
  ref = quantized_gated_mlp_reference(x, gu, dn, **kw)
  assert out.dtype == jnp.bfloat16 and out.shape == (t, h)
  # Same arithmetic as the reference (fp32 gate_up and SwiGLU, one bf16 rounding of the activation): only the
  # order of fp32 additions differs, which can move an activation across a bf16 rounding boundary.
  _assert_close(out, ref, f)


def test_quantized_gated_mlp_input_validation():
  from pallas_kernels.linear import quantized_gated_mlp  # pylint: disable=g-import-not-at-top
  x, gu = _linear_inputs(3, 256, 128, "mxfp8")
  _, dn = _linear_inputs(3, 128, 128, "mxfp8")
  with pytest.raises(NotImplementedError, match="bf16 activations"):
    quantized_gated_mlp(x.astype(jnp.float32), gu, dn, alpha=1.702, limit=7.0, interpret=True)
  with pytest.raises(ValueError, match=r"must be \[2F, H=128\] / \[H=128, F\]"):
    quantized_gated_mlp(x, gu, QuantizedWeight(dn.values[:, :64], dn.scales[:, :2], dn.fmt, dn.block), alpha=1.702,
                        limit=7.0, interpret=True)


def test_linear_heuristic_splits_the_reduction_at_decode():
  # M3's k / v projection (512 x 6144) has 4 output tiles: the reduction is split so that every SM streams.
  kv = heuristic_linear_tiles(1, 512, 6144, "mxfp8", 132)
  assert kv.k_splits >= 8 and kv.block_m == 8
  assert heuristic_linear_tiles(64, 24576, 6144, "mxfp8", 132).k_splits <= 2
  prefill = heuristic_linear_tiles(300, 8192, 6144, "mxfp8", 132)
  assert (prefill.block_m, prefill.k_splits) == (128, 1)


def test_quantized_matmul_input_validation():
  x, w = _linear_inputs(3, 256, 512, "mxfp8")
  with pytest.raises(NotImplementedError, match="bf16 activations"):
    quantized_matmul(x.astype(jnp.float32), w, interpret=True)
  with pytest.raises(ValueError, match="must agree on in"):
    quantized_matmul(x[:, :256], w, interpret=True)
  narrow = _quantize(np.ones((96, 512), np.float32), "mxfp8")
  with pytest.raises(NotImplementedError, match="does not tile"):
    quantized_matmul(x, narrow, interpret=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block"])
def test_identity_matmul_returns_the_dequantized_weight_exactly(mode, fmt):
  # x = I: each output is one exact product accumulated in fp32, so out == dequantize(w)^T bit for bit: the
  # in-register dequantization (PTX on the GPU) over every e4m3 byte and a spread of scales.
  in_f = 512
  byte = np.arange(256, dtype=np.uint8)
  byte = byte[~np.isnan(byte.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]
  values = np.resize(byte, (128, in_f)).view(ml_dtypes.float8_e4m3fn)
  rng = np.random.default_rng(0)
  if fmt == "mxfp8":
    scales = rng.integers(100, KERNEL_MAX_E8M0 + 1, size=(128, in_f // 32)).astype(np.uint8)
  else:
    scales = rng.uniform(1e-4, 1e-1, size=(1, in_f // 128)).astype(np.float32)
  w = QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), fmt, _BLOCK[fmt])
  out = quantized_matmul(jnp.eye(in_f, dtype=jnp.bfloat16), w, interpret=mode == "interpret")
  np.testing.assert_array_equal(np.asarray(out), np.asarray(dequantize(w, jnp.bfloat16).T))
