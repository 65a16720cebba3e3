"""M3 MoE block on Hopper: fp32 router (jnp), sort-by-expert dispatch, two tile-grouped Pallas
Mosaic-GPU GEMMs (gate_up with fused SwiGLU-OAI epilogue, down), fp32 weighted un-permute.

The shared expert rides in the same two launches (its tiles come first, expert id E) when its
width equals the routed expert width; otherwise it runs as a one-expert grouped GEMM beside them.

dtypes: bf16/f16 operands run natively (fp32 accumulation and epilogue, one rounding of the
activation, as M3_SPEC §2.5). fp32 operands run through the same bf16 kernels with a 3-pass split
(hi*hi + hi*lo + lo*hi, stacked along K), which is fp32-accurate to ~1e-5 relative at 3x the bf16
FLOPs plus a split copy of the weights: a correctness path, not a fast one. The split copy is made per call
unless the caller passes it (``prepare_expert_weights``, built once before a decode loop: XLA:GPU does not hoist
it out of the loop, so an fp32 decode loop would otherwise re-split every expert on every step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._fp32_split import split3_rhs
from pallas_kernels.moe import fp8
from pallas_kernels.moe.config import MoeBlockSizes
from pallas_kernels.moe.dispatch import Dispatch, build_broadcast_dispatch, build_dispatch
from pallas_kernels.moe.gemms import Gemms
from pallas_kernels.moe.routing import route
from pallas_kernels.quant import QuantizedWeight

_NATIVE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_activation_dtype(op: str, dtype) -> None:
  """NotImplementedError for activations other than bf16/f16/f32."""
  if jnp.dtype(dtype) not in (*_NATIVE, jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"{op} supports bf16/f16/f32 activations, got {dtype}")


def _reject_quantized(op: str, *weights) -> None:
  """NotImplementedError for fp8 QuantizedWeights where this bf16 / fp32 path was reached with them (mixed
  quantized / float operands, or prepared operands, which only bf16 / fp32 weights have); run_op then takes the
  reference."""
  if any(isinstance(w, QuantizedWeight) for w in weights):
    raise NotImplementedError(f"{op}: this bf16 / fp32 path does not take quantized (fp8) weights")


def _check_dtypes(op: str, x: jax.Array, **weights: jax.Array) -> None:
  """NotImplementedError for activations other than bf16/f16/f32 and for quantized (integer / 8-bit) weights."""
  _check_activation_dtype(op, x.dtype)
  for name, w in weights.items():
    if not jnp.issubdtype(w.dtype, jnp.floating) or w.dtype.itemsize < 2:
      raise NotImplementedError(f"{name} dtype {w.dtype} is not supported (quantized weights)")


def _check_expert_weights(w_gate_up, w_down, h, e=None):
  """ValueError unless w_gate_up is [E, H, 2I] and w_down [E, I, H] (E checked when given)."""
  if w_gate_up.ndim != 3 or w_gate_up.shape[1] != h or w_gate_up.shape[2] % 2 or e not in (None, w_gate_up.shape[0]):
    raise ValueError(f"w_gate_up must be [E={'E' if e is None else e}, H={h}, 2I], got {w_gate_up.shape}")
  e, _, two_i = w_gate_up.shape
  if w_down.shape != (e, two_i // 2, h):
    raise ValueError(f"w_down must be [E={e}, I={two_i // 2}, H={h}], got {w_down.shape}")


def _check_inputs(x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down, top_k):
  """Raises ValueError on inconsistent shapes, NotImplementedError on unsupported dtypes."""
  _reject_quantized("moe_block", w_gate_up, w_down, shared_gate_up, shared_down)
  if x.ndim != 2:
    raise ValueError(f"x must be [T, H], got {x.shape}")
  t, h = x.shape
  if router_w.ndim != 2 or router_w.shape[0] != h:
    raise ValueError(f"router_w must be [H={h}, E], got {router_w.shape}")
  e = router_w.shape[1]
  if correction_bias.shape != (e,):
    raise ValueError(f"correction_bias must be [E={e}], got {correction_bias.shape}")
  _check_expert_weights(w_gate_up, w_down, h, e)
  if shared_gate_up.ndim != 2 or shared_gate_up.shape[0] != h or shared_gate_up.shape[1] % 2:
    raise ValueError(f"shared_gate_up must be [H={h}, 2Is], got {shared_gate_up.shape}")
  if shared_down.shape != (shared_gate_up.shape[1] // 2, h):
    raise ValueError(f"shared_down must be [Is, H={h}], got {shared_down.shape}")
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k must be in [1, E={e}], got {top_k}")
  _check_dtypes("moe_block", x, w_gate_up=w_gate_up, w_down=w_down, shared_gate_up=shared_gate_up,
                shared_down=shared_down)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertOperands:
  """Expert weights as the grouped GEMMs read them (``prepare_expert_weights``).

  Native dtypes: the weights cast to the compute dtype. fp32: the bf16 3-pass split [hi; lo; hi] stacked
  along K, so K is 3x the weight's (gate_up [E, 3H, 2I], down [E, 3I, H], shared [3H, 2Is] / [3Is, H]).
  The shared expert's entries are None where only the routed experts are prepared (``routed_experts``).
  """

  gate_up: jax.Array
  down: jax.Array
  shared_gate_up: jax.Array | None = None
  shared_down: jax.Array | None = None


def _k_factor(dtype) -> int:
  return 3 if jnp.dtype(dtype) == jnp.float32 else 1


def _operand(w: jax.Array, dtype) -> jax.Array:
  return split3_rhs(w) if jnp.dtype(dtype) == jnp.float32 else w.astype(dtype)


def prepare_expert_weights(dtype, w_gate_up: jax.Array, w_down: jax.Array, shared_gate_up: jax.Array | None = None,
                           shared_down: jax.Array | None = None) -> ExpertOperands:
  """The GEMM operands of ``moe_block`` / ``routed_experts`` for activations of ``dtype``, to build once and
  pass as ``prepared`` to many calls (a decode loop). Only fp32 gains from it: its operands are a split copy,
  1.5x the fp32 weights' bytes; native dtypes use the weights as they are.

  Args:
    dtype: the activations' dtype (bf16 / f16 / f32), i.e. the kernels' compute dtype.
    w_gate_up [E, H, 2I], w_down [E, I, H]; optional shared_gate_up [H, 2Is], shared_down [Is, H].
  """
  _check_activation_dtype("prepare_expert_weights", dtype)
  _reject_quantized("prepare_expert_weights", w_gate_up, w_down, shared_gate_up, shared_down)
  _check_expert_weights(w_gate_up, w_down, w_gate_up.shape[1])
  if (shared_gate_up is None) != (shared_down is None):
    raise ValueError("prepare_expert_weights needs both shared_gate_up and shared_down, or neither")
  op = functools.partial(_operand, dtype=dtype)
  return ExpertOperands(op(w_gate_up), op(w_down), None if shared_gate_up is None else op(shared_gate_up),
                        None if shared_down is None else op(shared_down))


def _resolve_operands(prepared: ExpertOperands | None, dtype, w_gate_up, w_down, shared_gate_up=None,
                      shared_down=None) -> ExpertOperands:
  """``prepared`` checked against the weights it stands for (shapes and dtype for ``dtype``), else built here."""
  if prepared is None:
    return prepare_expert_weights(dtype, w_gate_up, w_down, shared_gate_up, shared_down)
  if not isinstance(prepared, ExpertOperands):
    raise TypeError(f"prepared must be an ExpertOperands (prepare_expert_weights), got {type(prepared).__name__}")
  f = _k_factor(dtype)
  op_dtype = jnp.bfloat16 if f == 3 else dtype
  pairs = {"gate_up": (prepared.gate_up, w_gate_up), "down": (prepared.down, w_down)}
  if shared_gate_up is not None:
    pairs.update(shared_gate_up=(prepared.shared_gate_up, shared_gate_up), shared_down=(prepared.shared_down,
                                                                                          shared_down))
  for name, (got, w) in pairs.items():
    want = (*w.shape[:-2], f * w.shape[-2], w.shape[-1])
    if got is None or got.shape != want or got.dtype != jnp.dtype(op_dtype):
      raise ValueError(
          f"prepared.{name} does not match the weights for {jnp.dtype(dtype).name} activations: expected "
          f"{jnp.dtype(op_dtype).name}{list(want)}, got "
          f"{None if got is None else f'{got.dtype.name}{list(got.shape)}'} (prepare_expert_weights with the "
          "activations' dtype)")
  return prepared


def _dispatch(expert_ids, x, *, num_experts, block_m, fuse_shared, drop_foreign=False) -> tuple[Dispatch, jax.Array]:
  """(Dispatch, lhs of the gate_up GEMM): the broadcast layout when T <= block_m (decode), else grouped."""
  t = x.shape[0]
  if t <= block_m:
    d = build_broadcast_dispatch(expert_ids, num_experts=num_experts, block_m=block_m, fuse_shared=fuse_shared,
                                 drop_foreign=drop_foreign)
    return d, jnp.pad(x, ((0, block_m - t), (0, 0)))
  d = build_dispatch(expert_ids, num_experts=num_experts, block_m=block_m, fuse_shared=fuse_shared,
                     drop_foreign=drop_foreign)
  return d, x[d.row_token]


def _combine(weights: jax.Array, y: jax.Array, pos: jax.Array, kept: jax.Array) -> jax.Array:
  """fp32 un-permute: sum_k weights[t, k] * y[pos[t, k]] over the kept assignments -> fp32 [T, H].

  Unrolled over the K slots (elementwise adds of K row gathers): one loop fusion on GPU, with its
  consumers, where a [T, K, H] gather + reduction took two launches.
  """
  out = None
  for k in range(pos.shape[1]):
    term = jnp.where(kept[:, k, None], weights[:, k, None] * y[pos[:, k]].astype(jnp.float32), 0.0)
    out = term if out is None else out + term
  return out


@functools.partial(
    jax.jit,
    static_argnames=("alpha", "limit", "interpret", "block_sizes", "num_sms"),
)
def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array | int = 0,
    *,
    alpha: float,
    limit: float,
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_sizes: tuple[MoeBlockSizes, MoeBlockSizes] | None = None,
    num_sms: int | None = None,
    prepared: ExpertOperands | None = None,
) -> jax.Array:
  """Routed experts only, for given routing (``routed_experts_reference``'s contract) on the Mosaic GPU kernels.

  The entry point of expert parallelism: each device passes the routing of all its tokens and its slice of
  the experts, [first_expert, first_expert + E_local); assignments to other experts are dropped before the
  GEMMs (no rows, no FLOPs) and contribute exact zeros.

  Args:
    x: [T, H]; weights fp32 [T, K]; expert_ids int32 [T, K] (global ids); w_gate_up [E_local, H, 2I];
      w_down [E_local, I, H]; first_expert: int32 scalar (may be traced).
    interpret / block_sizes / num_sms: as ``moe_block``.
    prepared: optional ``prepare_expert_weights(x.dtype, w_gate_up, w_down)`` built once (a decode loop);
      by default built here.

  Returns:
    fp32 [T, H], unscaled by routed_scaling_factor.

  Quantized experts (``QuantizedWeight`` w_gate_up [E_local, 2I, H], w_down [E_local, H, I]) run the fp8 W8A16
  kernels (``pallas_kernels.moe.fp8``; bf16 activations; ``block_sizes`` then takes ``Fp8Tiles`` and
  ``prepared`` does not apply).
  """
  if fp8.is_quantized(w_gate_up, w_down):
    if prepared is not None:
      raise ValueError("prepared operands are for bf16 / fp32 weights, not QuantizedWeight")
    return fp8.routed_experts_fp8(x, weights, expert_ids, w_gate_up, w_down, first_expert, alpha=alpha, limit=limit,
                                  interpret=interpret, tiles=block_sizes, num_sms=num_sms)
  if x.ndim != 2:
    raise ValueError(f"x must be [T, H], got {x.shape}")
  t, h = x.shape
  _check_expert_weights(w_gate_up, w_down, h)
  if weights.shape != expert_ids.shape or weights.ndim != 2 or weights.shape[0] != t:
    raise ValueError(f"weights {weights.shape} and expert_ids {expert_ids.shape} must both be [T={t}, K]")
  _check_dtypes("routed_experts", x, w_gate_up=w_gate_up, w_down=w_down)
  e_local = w_gate_up.shape[0]
  k = expert_ids.shape[1]
  ops = _resolve_operands(prepared, x.dtype, w_gate_up, w_down)
  if t == 0:
    return jnp.zeros((0, h), jnp.float32)
  gemms = Gemms.make(x.dtype, interpret, block_sizes, num_sms, t, k, e_local, alpha, limit,
                      widths=(w_down.shape[1],), hidden=h)
  d, lhs = _dispatch(expert_ids - first_expert, x, num_experts=e_local, block_m=gemms.block_m, fuse_shared=False,
                     drop_foreign=True)
  y = gemms(d.meta, lhs, ops.gate_up, ops.down, broadcast_lhs=d.row_token is None)
  return _combine(weights, y, d.pos, d.kept)


@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "interpret",
        "block_sizes", "num_sms", "fuse_shared",
    ),
)
def moe_block(
    x: jax.Array,
    router_w: jax.Array,
    correction_bias: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    shared_gate_up: jax.Array,
    shared_down: jax.Array,
    *,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_alpha: float,
    swiglu_limit: float,
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_sizes: tuple[MoeBlockSizes, MoeBlockSizes] | None = None,
    num_sms: int | None = None,
    fuse_shared: bool = True,
    prepared: ExpertOperands | None = None,
) -> jax.Array:
  """The M3 MoE block (same contract as ``moe_block_reference``) on Pallas Mosaic GPU kernels.

  Args:
    x: [T, H]; router_w [H, E] (fp32 math); correction_bias [E]; w_gate_up [E, H, 2I] (gate cols
      first); w_down [E, I, H]; shared_gate_up [H, 2Is]; shared_down [Is, H].
    interpret: True (or an InterpretGPUParams) runs the kernels in the CPU GPU-interpreter.
    block_sizes: (gate_up, down) tiles; both must share block_m. Default: heuristic_block_sizes.
    num_sms: persistent grid size (default: the device's SM count; 3 when interpreting).
    fuse_shared: run the shared expert inside the routed launches when Is == I.
    prepared: optional ``prepare_expert_weights(x.dtype, w_gate_up, w_down, shared_gate_up, shared_down)``,
      built once for many calls (an fp32 decode loop); by default the operands are built here, per call.

  Returns:
    [T, H] in x.dtype.

  Raises:
    ValueError: inconsistent shapes or block sizes. NotImplementedError: unsupported dtype or
    a shape that does not tile (H % block_k, I % block_n, H % block_n of the down GEMM).

  Quantized routed experts (``QuantizedWeight`` w_gate_up [E, 2I, H], w_down [E, H, I], checkpoint orientation;
  the shared expert [2Is, H] / [H, Is] quantized, or bf16 arrays in the layout above) run the fp8 W8A16 kernels
  (``pallas_kernels.moe.fp8``): bf16 activations only (others raise NotImplementedError), ``block_sizes`` then
  takes a pair of ``Fp8Tiles``, and ``prepared`` does not apply.
  """
  if fp8.is_quantized(w_gate_up, w_down):
    if prepared is not None:
      raise ValueError("prepared operands are for bf16 / fp32 weights, not QuantizedWeight")
    return fp8.moe_block_fp8(x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down,
                             top_k=top_k, routed_scaling_factor=routed_scaling_factor, swiglu_alpha=swiglu_alpha,
                             swiglu_limit=swiglu_limit, interpret=interpret, tiles=block_sizes, num_sms=num_sms,
                             fuse_shared=fuse_shared)
  if fp8.is_quantized(shared_gate_up, shared_down):
    raise NotImplementedError("a quantized shared expert beside bf16 / fp32 routed experts runs the reference")
  _check_inputs(x, router_w, correction_bias, w_gate_up, w_down, shared_gate_up, shared_down, top_k)
  t, h = x.shape
  e = router_w.shape[1]
  inter = w_gate_up.shape[2] // 2
  shared_inter = shared_down.shape[0]
  ops = _resolve_operands(prepared, x.dtype, w_gate_up, w_down, shared_gate_up, shared_down)
  if t == 0:
    return jnp.zeros((0, h), x.dtype)
  gemms = Gemms.make(x.dtype, interpret, block_sizes, num_sms, t, top_k, e, swiglu_alpha, swiglu_limit,
                      widths=(inter, shared_inter), hidden=h)
  bm = gemms.block_m
  fused = fuse_shared and shared_inter == inter

  weights, expert_ids = route(x, router_w, correction_bias, top_k=top_k)
  d, lhs = _dispatch(expert_ids, x, num_experts=e, block_m=bm, fuse_shared=fused)
  y = gemms(d.meta, lhs, ops.gate_up, ops.down, ops.shared_gate_up if fused else None,
            ops.shared_down if fused else None, broadcast_lhs=d.row_token is None)
  routed = _combine(weights, y, d.pos, d.kept)
  if fused:
    shared = y[:t]
  else:
    s_tiles = -(-t // bm)
    s_meta = jnp.concatenate([jnp.array([s_tiles], jnp.int32), jnp.zeros((s_tiles,), jnp.int32)])
    x_pad = jnp.pad(x, ((0, s_tiles * bm - t), (0, 0)))
    shared = gemms(s_meta, x_pad, ops.shared_gate_up[None], ops.shared_down[None])[:t]
  return (routed * routed_scaling_factor + shared.astype(jnp.float32)).astype(x.dtype)
