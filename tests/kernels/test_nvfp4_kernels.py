"""NVFP4 (W4A16) MoE kernels against dequantize + the bf16 reference, and the in-kernel dequantization arithmetic.

CPU: the Mosaic-GPU interpreter at the smallest dims the kernel takes (K % 256: 256 inputs a pipeline step; 128
output features a work item). The interpreter runs the jnp twin of the in-register dequantization
(``pallas_kernels._nvfp4_tiles``); the PTX routine's bit moves are emulated in numpy over every byte, and run for
real only in the ``gpu`` mode (sm90).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernel_modes
from pallas_kernels import _nvfp4_tiles
from pallas_kernels.moe import moe_block, moe_block_reference
from pallas_kernels.moe.kernel_sm90_fp8 import Fp8Tiles
from pallas_kernels.quant import QuantizedWeight, dequantize, quantize

MODES = kernel_modes.MODES
_KW = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)


def _bf16(w: QuantizedWeight) -> jax.Array:
  """The dequantized weight in the bf16 kernels' [in, out] layout."""
  return jnp.swapaxes(dequantize(w, jnp.bfloat16), -1, -2)


@pytest.mark.quick
def test_pair_ptx_bit_moves_and_tile_twin_are_exact():
  # Every byte, both nibbles: the PTX's f16 bits are e2m1 * 2^-14 (code 1 an f16 subnormal), so with the
  # scale times 2^14 and the global multiplier (fp32 products, one bf16 rounding) the weight is dequantize's.
  byte = np.arange(256, dtype=np.uint8)
  scales = np.array([0x08, 0x30, 0x38, 0x4B, 0x7E], np.uint8)  # e4m3 2^-6 .. 448
  gmul = np.float32(1.0 / 2688.0)  # not a power of two: the second product rounds
  for half in (0, 1):
    f16 = _nvfp4_tiles.emulate_pair_bits(byte, half).view(np.float16).astype(np.float32)
    s = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(16384.0)
    got = ((f16[None, :] * s[:, None]) * gmul).astype(ml_dtypes.bfloat16)
    packed = np.tile(byte, (len(scales), 1))
    group_scales = np.repeat(scales[:, None], 32, 1).view(ml_dtypes.float8_e4m3fn)
    w = QuantizedWeight(jnp.asarray(packed), jnp.asarray(group_scales), "nvfp4", (1, 16), jnp.full((1,), gmul))
    want = np.asarray(dequantize(w, jnp.bfloat16))[:, half::2]
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    twin = _nvfp4_tiles.dequant_jnp(jnp.asarray(packed[:, :128]), jnp.asarray(np.repeat(scales[:, None], 16, 1)),
                                    jnp.float32(gmul), half)
    np.testing.assert_array_equal(np.asarray(twin).view(np.uint16), want[:, :128].view(np.uint16))


@functools.cache
def _moe_inputs(t, h, inter, e, shared, seed=0):
  """x bf16 [T, H], router, bias, nvfp4 experts (gate_up with a global scale per part) and the shared expert
  (nvfp4 of the experts' width, or bf16)."""
  rng = np.random.default_rng(seed)
  nrm = lambda shape, scale: jnp.asarray(rng.normal(size=shape).astype(np.float32) * scale)
  x = nrm((t, h), 1.0).astype(jnp.bfloat16)
  router_w, bias = nrm((h, e), h ** -0.5), nrm((e,), 0.1)
  gu = quantize(nrm((e, 2 * inter, h), 3 * h ** -0.5), "nvfp4", parts=2)
  dn = quantize(nrm((e, h, inter), inter ** -0.5), "nvfp4")
  sgu, sdn = nrm((2 * inter, h), 3 * h ** -0.5), nrm((h, inter), inter ** -0.5)
  if shared == "nvfp4":
    sgu, sdn = quantize(sgu, "nvfp4", parts=2), quantize(sdn, "nvfp4")
  else:
    sgu, sdn = sgu.T.astype(jnp.bfloat16), sdn.T.astype(jnp.bfloat16)
  return x, router_w, bias, gu, dn, sgu, sdn


def _reference(args, top_k):
  x, router_w, bias, gu, dn, sgu, sdn = args
  deq = lambda w: _bf16(w) if isinstance(w, QuantizedWeight) else w
  return moe_block_reference(x, router_w, bias, deq(gu), deq(dn), deq(sgu), deq(sdn), top_k=top_k, **_KW)


# (name, T, shared expert, tiles): decode (broadcast layout, bf16 shared expert beside, as the model keeps it) and
# the grouped (prefill) dispatch with an nvfp4 shared expert fused into the launches.
CASES = [
    ("decode_3_tokens", 3, "bf16", None),
    ("grouped_fused_shared", 20, "nvfp4", (Fp8Tiles(block_m=16, max_concurrent_steps=2),
                                           Fp8Tiles(block_m=16, max_concurrent_steps=2))),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,t,shared,tiles", CASES, ids=[c[0] for c in CASES])
def test_nvfp4_moe_block_matches_reference(mode, name, t, shared, tiles):
  # The kernel's bf16 weights are dequantize's bit for bit; only the fp32 accumulation order differs (and, where
  # that moves a SwiGLU output across a bf16 rounding boundary, one bf16 ulp of the activation).
  args = _moe_inputs(t, 256, 256, 4, shared, seed=len(name))
  out = moe_block(*args, top_k=2, **_KW, interpret=mode == "interpret", block_sizes=tiles)
  ref = _reference(args, 2)
  out, ref = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
  assert out.shape == ref.shape and np.isfinite(out).all()
  np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
  assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.quick
def test_nvfp4_weights_are_checked_on_construction():
  packed, scales, g = jnp.zeros((2, 64, 128), jnp.uint8), jnp.zeros((2, 64, 16), jnp.float8_e4m3fn), jnp.ones((2, 2))
  assert QuantizedWeight(packed, scales, "nvfp4", (1, 16), g).shape == (2, 64, 256)
  with pytest.raises(ValueError, match=r"nvfp4 scales for packed values \[2, 64, 128\] \(in = 256, one scale per 16\) "
                                       r"must be \[2, 64, 16\], got \[2, 64, 8\]"):
    QuantizedWeight(packed, scales[..., :8], "nvfp4", (1, 16), g)
  with pytest.raises(ValueError, match="nvfp4 values must be uint8"):
    QuantizedWeight(packed.astype(jnp.int8), scales, "nvfp4", (1, 16), g)
  with pytest.raises(ValueError, match="needs its global_scale"):
    QuantizedWeight(packed, scales, "nvfp4", (1, 16))
  with pytest.raises(ValueError, match=r"global scale for values \[2, 64, 128\] must be \[2, P\] with P dividing 64, "
                                       r"got \[2, 3\]"):
    QuantizedWeight(packed, scales, "nvfp4", (1, 16), jnp.ones((2, 3)))
