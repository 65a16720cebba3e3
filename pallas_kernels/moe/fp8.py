"""The MoE block and routed experts with fp8 (``QuantizedWeight``) expert weights: W8A16 grouped GEMMs (and
W4A16 for NVFP4 weights: the same kernel reading packed nibbles, ``kernel_sm90_fp8``).

Weights keep the checkpoint orientation: w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I],
shared_gate_up [2Is, H], shared_down [H, Is], each a ``QuantizedWeight`` (mxfp8 or fp8_block). Routing, dispatch
and combine are ``api``'s; the two GEMMs are ``kernel_sm90_fp8.grouped_matmul_fp8`` (weights dequantized tile by
tile in registers, bf16 wgmma, fp32 accumulation: exact against ``dequantize`` + the bf16 reference).

Activations must be bf16 (fp32 / f16 activations raise NotImplementedError: the dispatcher's reference path
dequantizes instead). Decode (T <= 64 tokens) uses the broadcast layout with token tiles of T rounded up to 8
(wgmma N, not 64 padded rows); prefill uses 128-token tiles. A shared expert in another format (or bf16) or of
another width runs beside the routed launches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.dispatch import build_broadcast_dispatch, build_dispatch
from pallas_kernels.moe.gemms import Gemms
from pallas_kernels.moe.kernel_sm90_fp8 import SMEM_LIMIT_BYTES, Fp8Tiles, grouped_matmul_fp8
from pallas_kernels.moe.routing import route
from pallas_kernels.quant import QuantizedWeight

DECODE_MAX_TOKENS = 64  # up to this many tokens: the broadcast layout (every touched expert sees all tokens)
PREFILL_BLOCK_M = 128


def is_quantized(*ws: Any) -> bool:
  """Whether any of ``ws`` is a ``QuantizedWeight``."""
  return any(isinstance(w, QuantizedWeight) for w in ws)


def _need_bf16(op: str, x: jax.Array) -> None:
  if x.dtype != jnp.bfloat16:
    raise NotImplementedError(f"{op} with fp8 weights runs bf16 activations on the kernels, got {x.dtype} "
                              "(the reference dequantizes)")


def check_expert_weights(w_gate_up: QuantizedWeight, w_down: QuantizedWeight, h: int, e: int | None = None):
  """ValueError unless w_gate_up is [E, 2I, H] and w_down [E, H, I] quantized weights of one format."""
  if not (isinstance(w_gate_up, QuantizedWeight) and isinstance(w_down, QuantizedWeight)):
    raise ValueError("w_gate_up and w_down must both be QuantizedWeight (or both arrays)")
  if w_gate_up.fmt != w_down.fmt:
    raise ValueError(f"w_gate_up ({w_gate_up.fmt}) and w_down ({w_down.fmt}) must share a format")
  gu, dn = w_gate_up.shape, w_down.shape
  if len(gu) != 3 or gu[2] != h or gu[1] % 2 or e not in (None, gu[0]):
    raise ValueError(f"quantized w_gate_up must be [E={'E' if e is None else e}, 2I, H={h}], got {list(gu)}")
  if dn != (gu[0], h, gu[1] // 2):
    raise ValueError(f"quantized w_down must be [E={gu[0]}, H={h}, I={gu[1] // 2}], got {list(dn)}")


def check_shared_weights(shared_gate_up, shared_down, h: int) -> None:
  """ValueError unless the shared expert is [2Is, H] / [H, Is] (QuantizedWeight) or [H, 2Is] / [Is, H] (arrays)."""
  if isinstance(shared_gate_up, QuantizedWeight) != isinstance(shared_down, QuantizedWeight):
    raise ValueError("shared_gate_up and shared_down must both be QuantizedWeight (or both arrays)")
  if isinstance(shared_gate_up, QuantizedWeight):
    gu, dn = shared_gate_up.shape, shared_down.shape
    if len(gu) != 2 or gu[1] != h or gu[0] % 2 or dn != (h, gu[0] // 2):
      raise ValueError(f"quantized shared_gate_up / shared_down must be [2Is, H={h}] / [H={h}, Is], got "
                       f"{list(gu)} / {list(dn)}")
  else:
    if shared_gate_up.ndim != 2 or shared_gate_up.shape[0] != h or shared_gate_up.shape[1] % 2:
      raise ValueError(f"shared_gate_up must be [H={h}, 2Is], got {shared_gate_up.shape}")
    if shared_down.shape != (shared_gate_up.shape[1] // 2, h):
      raise ValueError(f"shared_down must be [Is, H={h}], got {shared_down.shape}")


def shared_width(shared_gate_up) -> int:
  """Is of a shared expert in either layout."""
  if isinstance(shared_gate_up, QuantizedWeight):
    return shared_gate_up.shape[0] // 2
  return shared_gate_up.shape[1] // 2


def _fit_stages(cfg: Fp8Tiles, n_parts: int, k: int, fmt: str, out_itemsize: int) -> Fp8Tiles:
  """The deepest pipeline (<= cfg's) that fits in SMEM."""
  while cfg.smem_bytes(n_parts, k, fmt, out_itemsize) > SMEM_LIMIT_BYTES:
    if cfg.max_concurrent_steps <= 2:
      raise NotImplementedError(f"{cfg} does not fit in {SMEM_LIMIT_BYTES} bytes of SMEM")
    cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
  return cfg


def heuristic_fp8_tiles(num_tokens: int, hidden: int, inter: int, fmt: str) -> tuple[Fp8Tiles, Fp8Tiles]:
  """(gate_up, down) tiles: decode token tiles of T rounded up to 8 with a deep pipeline; prefill 128-token
  tiles (nvfp4: 64, its 256-input activation stages of 128 tokens leave no room for two stages of gate_up),
  the pipeline as deep as SMEM allows (gate_up K = H, down K = I)."""
  if num_tokens <= DECODE_MAX_TOKENS:
    bm, stages = max(8, -(-num_tokens // 8) * 8), 6
  else:
    bm, stages = (64 if fmt == "nvfp4" else PREFILL_BLOCK_M), 4
  gate_up = _fit_stages(Fp8Tiles(block_m=bm, max_concurrent_steps=stages), 2, hidden, fmt, 2)
  # The down items: 256 output features where they tile (its K, I, is short for experts); 128 where the item's
  # whole-K scales would not fit beside the pipeline (a dense MLP's long K, e.g. M3's 12288).
  for down_rows in (2, 1) if hidden % 256 == 0 else (1,):
    try:
      down = _fit_stages(Fp8Tiles(block_m=bm, max_concurrent_steps=stages, row_tiles=down_rows), 1, inter, fmt, 2)
      break
    except NotImplementedError:
      if down_rows == 1:
        raise
  return gate_up, down


def _interp(interpret):
  return plgpu.InterpretGPUParams() if interpret is True else (interpret or False)


def _default_num_sms(interpret) -> int:
  if interpret or jax.default_backend() != "gpu":
    return 3
  return jax.extend.backend.get_default_device().core_count


@dataclasses.dataclass(frozen=True)
class Fp8Gemms:
  """gate_up (+ SwiGLU) then down, fp8 weights, over one dispatch."""

  interpret: Any
  num_sms: int
  gate_up_tiles: Fp8Tiles
  down_tiles: Fp8Tiles
  alpha: float
  limit: float

  @classmethod
  def make(cls, interpret, tiles, num_sms, tokens, hidden, inter, fmt, alpha, limit) -> "Fp8Gemms":
    gu, dn = tiles or heuristic_fp8_tiles(tokens, hidden, inter, fmt)
    if gu.block_m != dn.block_m:
      raise ValueError(f"gate_up and down block_m differ: {gu.block_m} vs {dn.block_m}")
    interp = _interp(interpret)
    return cls(interpret=interp, num_sms=num_sms or _default_num_sms(interp), gate_up_tiles=gu, down_tiles=dn,
               alpha=alpha, limit=limit)

  @property
  def block_m(self) -> int:
    return self.gate_up_tiles.block_m

  def __call__(self, meta, lhs, w_gate_up, w_down, s_gate_up=None, s_down=None, broadcast_lhs=False):
    """lhs bf16 [M_pad, H] grouped by meta's tiles (or [block_m, H], broadcast) -> bf16 [M_pad, H]."""
    kw = dict(num_sms=self.num_sms, interpret=self.interpret, alpha=self.alpha, limit=self.limit)
    act = grouped_matmul_fp8(meta, lhs, w_gate_up, s_gate_up, n_parts=2, epilogue="swiglu",
                             out_dtype=jnp.bfloat16, tiles_cfg=self.gate_up_tiles, broadcast_lhs=broadcast_lhs, **kw)
    return grouped_matmul_fp8(meta, act, w_down, s_down, n_parts=1, epilogue="none", out_dtype=jnp.bfloat16,
                              tiles_cfg=self.down_tiles, **kw)


def _dispatch(expert_ids, x, *, num_experts, block_m, fuse_shared, drop_foreign=False):
  """(Dispatch, gate_up lhs): broadcast (x padded to block_m rows) when T <= block_m, else grouped rows."""
  t = x.shape[0]
  if t <= block_m and t <= DECODE_MAX_TOKENS:
    d = build_broadcast_dispatch(expert_ids, num_experts=num_experts, block_m=block_m, fuse_shared=fuse_shared,
                                 drop_foreign=drop_foreign)
    return d, jnp.pad(x, ((0, block_m - t), (0, 0)))
  d = build_dispatch(expert_ids, num_experts=num_experts, block_m=block_m, fuse_shared=fuse_shared,
                     drop_foreign=drop_foreign)
  return d, x[d.row_token]


def _combine(weights, y, pos, kept):
  """fp32 sum_k weights[t, k] * y[pos[t, k]] over kept assignments -> fp32 [T, H] (as ``api._combine``)."""
  out = None
  for k in range(pos.shape[1]):
    term = jnp.where(kept[:, k, None], weights[:, k, None] * y[pos[:, k]].astype(jnp.float32), 0.0)
    out = term if out is None else out + term
  return out


def routed_experts_fp8(x, weights, expert_ids, w_gate_up: QuantizedWeight, w_down: QuantizedWeight,
                       first_expert=0, *, alpha, limit, interpret, tiles, num_sms) -> jax.Array:
  """``api.routed_experts`` with quantized experts: fp32 [T, H], unscaled."""
  if x.ndim != 2:
    raise ValueError(f"x must be [T, H], got {x.shape}")
  t, h = x.shape
  check_expert_weights(w_gate_up, w_down, h)
  if weights.shape != expert_ids.shape or weights.ndim != 2 or weights.shape[0] != t:
    raise ValueError(f"weights {weights.shape} and expert_ids {expert_ids.shape} must both be [T={t}, K]")
  _need_bf16("routed_experts", x)
  if t == 0:
    return jnp.zeros((0, h), jnp.float32)
  e_local, inter = w_gate_up.shape[0], w_down.shape[2]
  gemms = Fp8Gemms.make(interpret, tiles, num_sms, t, h, inter, w_gate_up.fmt, alpha, limit)
  d, lhs = _dispatch(expert_ids - first_expert, x, num_experts=e_local, block_m=gemms.block_m, fuse_shared=False,
                     drop_foreign=True)
  y = gemms(d.meta, lhs, w_gate_up, w_down, broadcast_lhs=d.row_token is None)
  return _combine(weights, y, d.pos, d.kept)


def dense_mlp_fp8(x, w_gate_up: QuantizedWeight, w_down: QuantizedWeight, gemms: Fp8Gemms) -> jax.Array:
  """One dense SwiGLU-OAI MLP with fp8 weights, gate_up [2F, H] and down [H, F], as a one-expert grouped GEMM
  pair (gate_up with the SwiGLU epilogue in fp32 on its accumulators, one bf16 rounding, then down):
  x bf16 [T, H] -> bf16 [T, H]."""
  t = x.shape[0]
  one = lambda w: QuantizedWeight(w.values[None], w.scales[None], w.fmt, w.block,
                                  None if w.global_scale is None else w.global_scale[None])
  bm = gemms.block_m
  s_tiles = -(-t // bm)
  meta = jnp.concatenate([jnp.array([s_tiles], jnp.int32), jnp.zeros((s_tiles,), jnp.int32)])
  return gemms(meta, jnp.pad(x, ((0, s_tiles * bm - t), (0, 0))), one(w_gate_up), one(w_down))[:t]


def _shared_alone(x, shared_gate_up, shared_down, gemms: Fp8Gemms, *, alpha, limit, interpret, num_sms):
  """The shared expert beside the routed launches: a one-expert fp8 grouped GEMM, or the bf16 kernels when the
  shared weights are arrays -> [T, H] in x.dtype."""
  t = x.shape[0]
  if not isinstance(shared_gate_up, QuantizedWeight):
    bf = Gemms.make(x.dtype, interpret, None, num_sms, t, 1, 1, alpha, limit,
                     widths=(shared_down.shape[0],), hidden=x.shape[1])
    bm = bf.block_m
    s_tiles = -(-t // bm)
    meta = jnp.concatenate([jnp.array([s_tiles], jnp.int32), jnp.zeros((s_tiles,), jnp.int32)])
    return bf(meta, jnp.pad(x, ((0, s_tiles * bm - t), (0, 0))), shared_gate_up[None], shared_down[None])[:t]
  return dense_mlp_fp8(x, shared_gate_up, shared_down, gemms)


def moe_block_fp8(x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down, *, top_k,
                  routed_scaling_factor, swiglu_alpha, swiglu_limit, interpret, tiles, num_sms, fuse_shared):
  """``api.moe_block`` with quantized routed experts (the shared expert quantized or bf16) -> [T, H] bf16."""
  if x.ndim != 2:
    raise ValueError(f"x must be [T, H], got {x.shape}")
  t, h = x.shape
  if router_w.ndim != 2 or router_w.shape[0] != h:
    raise ValueError(f"router_w must be [H={h}, E], got {router_w.shape}")
  e = router_w.shape[1]
  if correction_bias.shape != (e,):
    raise ValueError(f"correction_bias must be [E={e}], got {correction_bias.shape}")
  check_expert_weights(w_gate_up, w_down, h, e)
  check_shared_weights(shared_gate_up, shared_down, h)
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k must be in [1, E={e}], got {top_k}")
  _need_bf16("moe_block", x)
  if t == 0:
    return jnp.zeros((0, h), x.dtype)
  inter = w_down.shape[2]
  gemms = Fp8Gemms.make(interpret, tiles, num_sms, t, h, inter, w_gate_up.fmt, swiglu_alpha, swiglu_limit)
  fused = (fuse_shared and isinstance(shared_gate_up, QuantizedWeight) and shared_gate_up.fmt == w_gate_up.fmt
           and shared_width(shared_gate_up) == inter)
  weights, expert_ids = route(x, router_w, correction_bias, top_k=top_k)
  d, lhs = _dispatch(expert_ids, x, num_experts=e, block_m=gemms.block_m, fuse_shared=fused)
  y = gemms(d.meta, lhs, w_gate_up, w_down, shared_gate_up if fused else None, shared_down if fused else None,
            broadcast_lhs=d.row_token is None)
  routed = _combine(weights, y, d.pos, d.kept)
  if fused:
    shared = y[:t]
  else:
    shared = _shared_alone(x, shared_gate_up, shared_down, gemms, alpha=swiglu_alpha, limit=swiglu_limit,
                           interpret=interpret, num_sms=num_sms)
  return (routed * routed_scaling_factor + shared.astype(jnp.float32)).astype(x.dtype)
