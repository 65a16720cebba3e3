"""``quantized_matmul``: x [T, in] @ W^T for an fp8 ``QuantizedWeight`` W [out, in], on the fp8 W8A16 kernel.

The weight is read from HBM as 1 byte a weight plus its block scales, dequantized tile by tile in registers and
multiplied on the bf16 tensor cores (``pallas_kernels.moe.kernel_sm90_fp8``, run as a one-expert grouped GEMM):
exact against ``dequantize(w, bfloat16)`` followed by an fp32-accumulated bf16 matmul.

Decode (T <= 64) is bandwidth-bound and has few output tiles, so the reduction dim is split across work items
(``k_splits``) until every SM streams weights; the fp32 partial sums ([k_splits, out, T], small next to the
weight) are added by XLA. Prefill (T > 64) runs 128-token tiles without a split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.kernel_sm90_fp8 import SCALE_K_ALIGN, SMEM_LIMIT_BYTES, Fp8Tiles, grouped_matmul_fp8
from pallas_kernels.quant import QuantizedWeight

DECODE_MAX_TOKENS = 64
_ITEM_OVERHEAD_K = 384  # a work item's fixed cost (scale copy, pipeline fill, epilogue) in K columns streamed


def _fit_stages(cfg: Fp8Tiles, k: int, fmt: str, out_itemsize: int) -> Fp8Tiles:
  while cfg.smem_bytes(1, k, fmt, out_itemsize) > SMEM_LIMIT_BYTES:
    if cfg.max_concurrent_steps <= 2:
      raise NotImplementedError(f"{cfg} does not fit in {SMEM_LIMIT_BYTES} bytes of SMEM")
    cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
  return cfg


def heuristic_linear_tiles(num_tokens: int, out_features: int, in_features: int, fmt: str,
                           num_sms: int = 132, out_itemsize: int = 2) -> Fp8Tiles:
  """Tiles for x [T, in] @ W^T [in, out] (an output of ``out_itemsize`` bytes a value). Decode: token tile T
  rounded up to 8, and the (row tiles, K splits) pair that minimises the modelled time
  ceil(items / SMs) * block_n * (K / splits + overhead); prefill: 128-token tiles, 256-feature items where they
  tile."""
  if num_tokens > DECODE_MAX_TOKENS:  # the widest item whose whole-K scales and pipeline fit in SMEM
    for rt, bm in ((2, 128), (1, 128), (1, 64)):
      if out_features % (128 * rt):
        continue
      try:
        return _fit_stages(Fp8Tiles(block_m=bm, max_concurrent_steps=4, row_tiles=rt), in_features, fmt,
                           out_itemsize)
      except NotImplementedError:
        continue
    raise NotImplementedError(f"an fp8 [{out_features}, {in_features}] weight does not tile for prefill")
  bm = max(8, -(-num_tokens // 8) * 8)
  best = None
  for rt in (1, 2):
    block_n = 128 * rt
    if out_features % block_n:
      continue
    items = out_features // block_n
    for splits in range(1, in_features // 128 + 1):
      kc, rem = divmod(in_features, splits)
      if rem or kc % 128 or (splits > 1 and kc % SCALE_K_ALIGN) or (fmt == "fp8_block" and kc % SCALE_K_ALIGN):
        continue
      cost = math.ceil(items * splits / num_sms) * block_n * (kc + _ITEM_OVERHEAD_K)
      if best is None or cost < best[0]:
        best = (cost, rt, splits)
  if best is None:
    raise NotImplementedError(f"an fp8 [{out_features}, {in_features}] weight does not tile (out % 128, in % 128)")
  _, rt, splits = best
  out_itemsize = 4 if splits > 1 else out_itemsize
  return _fit_stages(Fp8Tiles(block_m=bm, max_concurrent_steps=6, k_splits=splits, row_tiles=rt), in_features,
                     fmt, out_itemsize)


def _num_sms(interpret) -> int:
  if interpret or jax.default_backend() != "gpu":
    return 3
  return jax.extend.backend.get_default_device().core_count


@functools.partial(jax.jit, static_argnames=("interpret", "tiles", "num_sms", "out_dtype"))
def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, interpret: Any = False, tiles: Fp8Tiles | None = None,
                     num_sms: int | None = None, out_dtype: Any = None) -> jax.Array:
  """x [T, in] @ dequantize(w)^T -> [T, out] in ``out_dtype`` (default x.dtype; fp32 accumulation), on the fp8
  kernel. ``out_dtype=float32`` returns the fp32 accumulators unrounded (e.g. for an fp32 SwiGLU after it).

  Args:
    x: bf16 [T, in] (other dtypes raise NotImplementedError: the reference dequantizes).
    w: QuantizedWeight [out, in] (mxfp8 or fp8_block), checkpoint orientation.
    interpret: False, True or plgpu.InterpretGPUParams (the GPU interpreter on CPU).
    tiles: Fp8Tiles; default heuristic_linear_tiles.
    num_sms: persistent grid size (default: the device's SM count; 3 when interpreting).

  Raises:
    ValueError: inconsistent shapes. NotImplementedError: a dtype or shape the kernel does not take
    (out % 128, in % 128; fp8_block needs in % 512).
  """
  if not isinstance(w, QuantizedWeight):
    raise TypeError(f"w must be a QuantizedWeight, got {type(w).__name__}")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"x [T, in] and w [out, in] must agree on in, got x {x.shape} and w {w.shape}")
  if x.dtype != jnp.bfloat16:
    raise NotImplementedError(f"quantized_matmul runs bf16 activations on the kernel, got {x.dtype}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"quantized_matmul returns bf16 or fp32, got out_dtype={out_dtype.name}")
  t = x.shape[0]
  out_features, in_features = w.shape
  if t == 0:
    return jnp.zeros((0, out_features), out_dtype)
  interp = plgpu.InterpretGPUParams() if interpret is True else (interpret or False)
  sms = num_sms or _num_sms(interp)
  cfg = tiles or heuristic_linear_tiles(t, out_features, in_features, w.fmt, sms, out_dtype.itemsize)
  bm = cfg.block_m
  m_tiles = -(-t // bm)
  meta = jnp.concatenate([jnp.array([m_tiles], jnp.int32), jnp.zeros((m_tiles,), jnp.int32)])
  lhs = jnp.pad(x, ((0, m_tiles * bm - t), (0, 0)))
  one = QuantizedWeight(w.values[None], w.scales[None], w.fmt, w.block)
  y = grouped_matmul_fp8(meta, lhs, one, None, n_parts=1, epilogue="none", out_dtype=out_dtype, tiles_cfg=cfg,
                         num_sms=sms, interpret=interp)
  if cfg.k_splits > 1 or out_dtype == jnp.float32:  # fp32 (partial) sums, transposed: [k_splits, out, M_pad]
    return jnp.sum(y, axis=0).T[:t].astype(out_dtype)
  return y[:t]
