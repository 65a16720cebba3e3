"""One pre-norm M3 decoder layer: h += Attn(norm(h)); h += FFN(norm(h)) (M3_SPEC §2.2)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.cache import LayerCache
from m3jax.config import TextConfig
from m3jax.layers.attention import Attention
from m3jax.layers.fused_quantized import FusedQuantizedWeights
from m3jax.layers.mlp import DenseMLP, MoE
from m3jax.layers.norms import RMSNorm
from m3jax.ops import moe as moe_ops
from m3jax.ops.dispatch import KernelChoice
from m3jax.parallel.projection import FusedWeights
from m3jax.research import Collect
from m3jax.sharding import constrain

_RESIDUAL = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """One layer's weights prepared once before a decode loop and passed to every step, so that the loop does not
  rebuild them per step (XLA:GPU hoists neither out of an on-device loop; BENCHMARKS.md).

  projection: the attention's q / k / v (/ index) weights fused (``Attention.fused_weights``: bf16 / fp32
    ``FusedWeights`` or fp8 ``FusedQuantizedWeights``), or None.
  experts: the MoE kernels' operands (``MoE.prepared_experts``: fp32 weights' bf16 split), or None.
  """

  projection: FusedWeights | FusedQuantizedWeights | None = None
  experts: moe_ops.ExpertOperands | None = None


class DecoderLayer(nnx.Module):
  """Layer ``index`` of the text backbone; its attention and MLP kinds come from the config's layouts, unless
  ``attention_type`` ('full' | 'sparse') / ``mlp_type`` ('dense' | 'moe') force them (the MTP block is a
  sparse + MoE layer whatever the layouts say; M3_SPEC §8)."""

  def __init__(self, cfg: TextConfig, index: int, *, dtype: jnp.dtype, kernels: KernelChoice,
               rngs: nnx.Rngs | None, attention_type: str | None = None, mlp_type: str | None = None):
    attention_type = attention_type or cfg.attention_types[index]
    mlp_type = mlp_type or cfg.mlp_types[index]
    self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.post_attention_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.attn = Attention(cfg, sparse=attention_type == "sparse", dtype=dtype, kernels=kernels,
                          rngs=rngs)
    if mlp_type == "moe":
      self.mlp = MoE(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
    else:
      self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, alpha=cfg.swiglu_alpha,
                          limit=cfg.swiglu_limit, dtype=dtype, rngs=rngs, kernels=kernels)

  def decode_weights(self) -> DecodeWeights:
    """This layer's ``DecodeWeights``, to build once before a decode loop (inside the same jit)."""
    experts = self.mlp.prepared_experts() if isinstance(self.mlp, MoE) else None
    return DecodeWeights(projection=self.attn.fused_weights(), experts=experts)

  def __call__(
      self, h: jax.Array, *, positions: jax.Array, cos: jax.Array, sin: jax.Array, cache: LayerCache | None,
      collect: Collect | None = None, prepared: DecodeWeights | None = None, dense_attention: bool = False,
  ) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]:
    """h [B,S,H] -> ([B,S,H], updated cache, research record (empty unless ``collect``)).

    ``prepared``: ``self.decode_weights()`` built before a decode loop; by default each part prepares its
    weights itself, per call. ``dense_attention``: a sparse layer attends densely (Attention.__call__)."""
    prepared = prepared or DecodeWeights()
    attn_out, cache, record = self.attn(self.input_norm(h), positions=positions, cos=cos, sin=sin, cache=cache,
                                        collect=collect, projection=prepared.projection,
                                        dense_attention=dense_attention)
    h = constrain(h + attn_out, _RESIDUAL)
    mlp_in = self.post_attention_norm(h)
    mlp_out = self.mlp(mlp_in, prepared.experts) if isinstance(self.mlp, MoE) else self.mlp(mlp_in)
    h = constrain(h + mlp_out, _RESIDUAL)
    if collect is not None and collect.routing and isinstance(self.mlp, MoE):
      record.update(self.mlp.routing(mlp_in))
    if collect is not None and collect.residual:
      record["residual"] = h
    return h, cache, record
