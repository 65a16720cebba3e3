"""The two grouped bf16 / f16 / fp32 GEMMs of an expert MLP (gate_up with the SwiGLU-OAI epilogue, then down) over a
tile dispatch, with the kernel options resolved: shared by ``api`` (routed and shared experts) and ``fp8`` (a bf16
shared expert beside fp8 routed experts)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._fp32_split import split3_lhs
from pallas_kernels.moe.config import SMEM_LIMIT_BYTES, MoeBlockSizes, heuristic_block_sizes
from pallas_kernels.moe.kernel_sm90 import grouped_matmul


def _fit_smem(bs: MoeBlockSizes, n_parts: int, out_itemsize: int) -> MoeBlockSizes:
  """Shrinks the pipeline depth until the CTA fits in shared memory."""
  while bs.smem_bytes(n_parts, 2, out_itemsize) > SMEM_LIMIT_BYTES:
    if bs.max_concurrent_steps <= 2:
      raise NotImplementedError(f"{bs} does not fit in {SMEM_LIMIT_BYTES} bytes of SMEM")
    bs = dataclasses.replace(bs, max_concurrent_steps=bs.max_concurrent_steps - 1)
  return bs


def _default_num_sms(interpret: Any) -> int:
  if interpret or jax.default_backend() != "gpu":
    return 3  # interpreter: a small persistent grid still runs several work items per "SM"
  return jax.extend.backend.get_default_device().core_count


@dataclasses.dataclass(frozen=True)
class Gemms:
  """The two grouped GEMMs of an expert MLP over a dispatch, with the kernel options resolved."""

  dtype: Any
  interpret: Any
  num_sms: int
  gate_up_tiles: MoeBlockSizes
  down_tiles: MoeBlockSizes
  alpha: float
  limit: float

  @classmethod
  def make(cls, dtype, interpret, block_sizes, num_sms, tokens, top_k, experts, alpha, limit,
           widths: tuple[int, ...] = (), hidden: int | None = None) -> "Gemms":
    """widths: the expert widths these GEMMs will run (I, and Is for the shared expert); hidden: H."""
    interp = plgpu.InterpretGPUParams() if interpret is True else (interpret or False)
    bs_gu, bs_dn = block_sizes or heuristic_block_sizes(
        tokens, top_k, experts, gate_up_widths=widths, down_widths=() if hidden is None else (hidden,))
    if bs_gu.block_m != bs_dn.block_m:
      raise ValueError(f"gate_up and down block_m differ: {bs_gu.block_m} vs {bs_dn.block_m}")
    out_itemsize = 4 if dtype == jnp.float32 else jnp.dtype(dtype).itemsize
    return cls(dtype=dtype, interpret=interp, num_sms=num_sms or _default_num_sms(interp),
               gate_up_tiles=_fit_smem(bs_gu, 2, out_itemsize), down_tiles=_fit_smem(bs_dn, 1, out_itemsize),
               alpha=alpha, limit=limit)

  @property
  def block_m(self) -> int:
    return self.gate_up_tiles.block_m

  def __call__(self, meta, lhs, wgu, wd, sgu=None, sd=None, broadcast_lhs=False) -> jax.Array:
    """lhs [M_pad, H] grouped by meta's tiles (or [block_m, H] read by every tile, broadcast_lhs)
    -> [M_pad, H] in dtype (rows of dead tiles unwritten). Weights: GEMM operands (``ExpertOperands``'
    arrays, K already split for fp32)."""
    prep_lhs = split3_lhs if self.dtype == jnp.float32 else (lambda a: a)
    mm = functools.partial(grouped_matmul, num_sms=self.num_sms, interpret=self.interpret, alpha=self.alpha,
                           limit=self.limit)
    act = mm(meta, prep_lhs(lhs), wgu, sgu, n_parts=2, epilogue="swiglu", out_dtype=self.dtype,
             block_sizes=self.gate_up_tiles, broadcast_lhs=broadcast_lhs)
    return mm(meta, prep_lhs(act), wd, sd, n_parts=1, epilogue="none", out_dtype=self.dtype,
              block_sizes=self.down_tiles)
