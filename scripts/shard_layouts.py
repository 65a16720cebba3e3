"""One GPU's share of MiniMax M3 in an 8-way split, in the two expert layouts, with bf16 or MXFP8 weights: the
model ``scripts/bench_full.py --one-shard WAYS`` runs on one device.

Layouts (what differs is only the routed experts; attention heads, the dense MLP, the shared expert and the
vocabulary are split WAYS ways in both, see ``bench_full.shard_config``):

  * ``slices`` -- every one of the E routed experts at 1/WAYS of its width (SGLang's TP8 layout): the model is
    ``M3ForCausalLM`` of the shard config (I / WAYS).
  * ``experts`` -- E / WAYS whole experts (m3jax's meshes: the ``experts`` rule splits experts over expert x
    tensor, ``m3jax.parallel.moe``): each MoE layer routes every token over all E experts (fp32 router,
    replicated), computes only the assignments to its local experts [first, first + E / WAYS) with
    ``routed_experts`` (the fp8 / bf16 kernels), adds its slice of the shared expert; the 8-GPU mesh would then
    add the devices' partial sums (not here: one device, no collectives, as in ``slices``).

Weights: ``bf16`` (random normal, std 0.02) or ``mxfp8`` (every linear weight the model can keep in fp8 --
attention / indexer projections, dense and shared MLPs, routed experts -- as ``QuantizedLinear``; random e4m3
values of a normal(0, 64) draw and E8M0 codes in [112, 118], i.e. weights of ~1e-2, as scripts/bench_fp8.py), each
leaf drawn on the device in its sharding by a per-shape jit (no host copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.config import M3Config, TextConfig
from m3jax.layers.mlp import DenseMLP, MoE
from m3jax.layers.params import make_param
from m3jax.layers.quantized import apply_quantized, quantize_all, weight_of
from m3jax.model import M3ForCausalLM
from m3jax.ops.dispatch import KernelChoice, run_op
from pallas_kernels.moe.reference import route_reference, routed_experts_reference

LAYOUTS = ("slices", "experts")
WEIGHTS = ("bf16", "mxfp8")
FP8_BYTES = 1 + 1 / 32  # MXFP8: one e4m3 byte per weight and one E8M0 scale byte per 32


class LocalExpertsMoE(MoE):
  """The MoE block as one device of an expert-parallel mesh computes it (module docstring, layout ``experts``).

  Parameters as ``MoE``'s (so routing records, ``balance_routing`` and fp8 quantization work unchanged), with the
  routed experts cut to the local ones: router [H, E], correction_bias [E], w_gate_up [E_local, H, 2I],
  w_down [E_local, I, H]; shared [H, 2Is] / [Is, H] (the shard config's slice).
  """

  def __init__(self, cfg: TextConfig, *, local_experts: int, first_expert: int, dtype: jnp.dtype,
               kernels: KernelChoice, rngs: nnx.Rngs | None):
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    if first_expert < 0 or first_expert + local_experts > e:
      raise ValueError(f"local experts [{first_expert}, {first_expert + local_experts}) outside the {e} experts")
    self.kernels = kernels
    self.top_k = cfg.num_experts_per_tok
    self.scale = cfg.routed_scaling_factor
    self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
    self.first_expert = first_expert
    self.router = make_param(rngs, (h, e), jnp.float32, (ax.EMBED, None))
    self.correction_bias = make_param(rngs, (e,), jnp.float32, (None,), init="zeros")
    self.w_gate_up = make_param(rngs, (local_experts, h, 2 * i), dtype, (ax.EXPERTS, ax.EMBED, ax.EXPERT_MLP))
    self.w_down = make_param(rngs, (local_experts, i, h), dtype, (ax.EXPERTS, ax.EXPERT_MLP, ax.EMBED))
    self.shared = DenseMLP(h, cfg.shared_intermediate_size, alpha=self.alpha, limit=self.limit, dtype=dtype,
                           rngs=rngs, kernels=kernels)

  def __call__(self, x: jax.Array, prepared=None) -> jax.Array:
    """x [B, S, H] -> [B, S, H]: this device's routed experts (scaled) + its shared-expert slice."""
    del prepared  # bf16 / fp8 weights: the kernels read them as they are
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    weights, ids, _ = route_reference(flat, self.router[...], self.correction_bias[...], top_k=self.top_k)
    routed = run_op(self.kernels, kernel_module="pallas_kernels.moe", kernel_name="routed_experts",
                    reference=routed_experts_reference,
                    args=(flat, weights, ids, weight_of(self.w_gate_up), weight_of(self.w_down),
                          jnp.asarray(self.first_expert, jnp.int32)),
                    kwargs=dict(alpha=self.alpha, limit=self.limit))
    shared = self.shared(flat)
    return (routed * self.scale + shared.astype(jnp.float32)).astype(x.dtype).reshape(b, s, h)

  def prepared_experts(self):
    return None


def local_experts(text: TextConfig, ways: int) -> int:
  """Whole experts per device in the ``experts`` layout; ValueError naming E and WAYS if they do not divide."""
  if text.num_experts % ways:
    raise ValueError(f"--layout experts: {text.num_experts} experts do not split over {ways} devices")
  return text.num_experts // ways


def build_model(cfg: M3Config, *, dtype, kernels: KernelChoice, weights: str, layout: str, ways: int | None,
                rngs: nnx.Rngs | None) -> M3ForCausalLM:
  """The one-device model (run under ``nnx.eval_shape`` for an abstract one): ``cfg`` is the shard config (in the
  ``experts`` layout with the experts' whole width), MoE layers swapped for ``LocalExpertsMoE`` in that layout,
  linear weights kept in MXFP8 for ``weights='mxfp8'``."""
  if weights not in WEIGHTS or layout not in LAYOUTS:
    raise ValueError(f"weights {weights!r} / layout {layout!r}: expected one of {WEIGHTS} / {LAYOUTS}")
  if layout == "experts" and not ways:
    raise ValueError("--layout experts needs --one-shard WAYS")
  build_cfg = cfg
  if layout == "experts":  # the experts are replaced below; build MoE layers with one expert, not E
    build_cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_experts=1, num_experts_per_tok=1))
  model = M3ForCausalLM(build_cfg, dtype=dtype, kernels=kernels, rngs=rngs)
  if layout == "experts":
    n_local = local_experts(cfg.text, ways)
    for layer in model.layers:
      if isinstance(layer.mlp, MoE):
        layer.mlp = LocalExpertsMoE(cfg.text, local_experts=n_local, first_expert=0, dtype=dtype, kernels=kernels,
                                    rngs=rngs)
  if weights == "mxfp8":
    apply_quantized(model, quantize_all([p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]))
  return model


@functools.lru_cache(maxsize=None)
def random_leaf(shape: tuple[int, ...], dtype: jnp.dtype, out_sharding, std: float = 0.02):
  """A jitted key -> random array of ``shape`` / ``dtype`` created directly in ``out_sharding``: float
  N(0, std^2); float8_e4m3fn values of a normal(0, 64) draw; uint8 E8M0 codes in [112, 118] (MXFP8 scales)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.dtype(jnp.float8_e4m3fn):
    fn = lambda key: (jax.random.normal(key, shape, jnp.bfloat16) * 64).astype(dtype)
  elif dtype == jnp.dtype(jnp.uint8):
    fn = lambda key: jax.random.randint(key, shape, 112, 119).astype(dtype)
  else:
    fn = lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)
  return jax.jit(fn, out_shardings=out_sharding)


def decode_weight_bytes(t: TextConfig, batch: int, distinct_experts: list[float] | None = None, *,
                        fp8: bool = False) -> float:
  """Weights one decode step reads, all GPUs together (``decode_analysis.decode_weight_bytes`` with the bytes
  per weight of ``weights``: 2 for bf16; MXFP8's 1 + 1/32 for every linear weight but the LM head)."""
  from decode_analysis import decode_weight_bytes as bf16_bytes  # pylint: disable=g-import-not-at-top

  total = bf16_bytes(t, batch, distinct_experts)
  if not fp8:
    return total
  head = 2 * t.hidden_size * t.vocab_size
  return head + (total - head) / 2 * FP8_BYTES


def shard_weight_bytes(full: TextConfig, batch: int, *, ways: int, layout: str, fp8: bool,
                       counts: list[float] | None = None) -> float:
  """Weights one GPU reads per decode step. ``counts``: measured experts touched per MoE layer -- in ``slices``
  of all E (each read at 1/WAYS of its width), in ``experts`` of this device's E / WAYS (read whole). Without
  counts: uniform routing's expectation, the same in both layouts (E/WAYS whole experts touched with 1/WAYS of
  the probability mass)."""
  if counts is None or layout == "slices":
    return decode_weight_bytes(full, batch, counts, fp8=fp8) / ways
  n_moe = sum(m == "moe" for m in full.mlp_types)
  if len(counts) != n_moe:
    raise ValueError(f"{len(counts)} expert counts for {n_moe} MoE layers")
  rest = decode_weight_bytes(full, batch, [0] * n_moe, fp8=fp8) / ways
  per_expert = 3 * full.hidden_size * full.intermediate_size * (FP8_BYTES if fp8 else 2)
  return rest + sum(counts) * per_expert


def expected_local_experts(full: TextConfig, batch: int, ways: int) -> float:
  """Uniform routing: expected distinct experts of one device's E / WAYS that ``batch`` tokens touch."""
  k, e = full.num_experts_per_tok, full.num_experts
  return e / ways * (1 - (1 - k / e) ** batch) if e and batch else 0.0
