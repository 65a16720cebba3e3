"""One pre-norm M3 decoder layer: h += Attn(norm(h)); h += FFN(norm(h)) (M3_SPEC §2.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.cache import LayerCache
from m3jax.config import TextConfig
from m3jax.layers.attention import Attention
from m3jax.layers.mlp import DenseMLP, MoE
from m3jax.layers.norms import RMSNorm
from m3jax.ops.dispatch import KernelChoice
from m3jax.parallel.projection import FusedWeights
from m3jax.research import Collect
from m3jax.sharding import constrain

_RESIDUAL = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)


class DecoderLayer(nnx.Module):
  """Layer ``index`` of the text backbone; its attention and MLP kinds come from the config's layouts."""

  def __init__(self, cfg: TextConfig, index: int, *, dtype: jnp.dtype, kernels: KernelChoice,
               rngs: nnx.Rngs | None):
    self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.post_attention_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.attn = Attention(cfg, sparse=cfg.attention_types[index] == "sparse", dtype=dtype, kernels=kernels,
                          rngs=rngs)
    if cfg.mlp_types[index] == "moe":
      self.mlp = MoE(cfg, dtype=dtype, kernels=kernels, rngs=rngs)
    else:
      self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, alpha=cfg.swiglu_alpha,
                          limit=cfg.swiglu_limit, dtype=dtype, rngs=rngs)

  def __call__(
      self, h: jax.Array, *, positions: jax.Array, cos: jax.Array, sin: jax.Array, cache: LayerCache | None,
      collect: Collect | None = None, projection: FusedWeights | None = None,
  ) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]:
    """h [B,S,H] -> ([B,S,H], updated cache, research record (empty unless ``collect``)).

    ``projection``: ``self.attn.fused_weights()`` built before a decode loop (see Attention)."""
    attn_out, cache, record = self.attn(self.input_norm(h), positions=positions, cos=cos, sin=sin, cache=cache,
                                        collect=collect, projection=projection)
    h = constrain(h + attn_out, _RESIDUAL)
    mlp_in = self.post_attention_norm(h)
    h = constrain(h + self.mlp(mlp_in), _RESIDUAL)
    if collect is not None and collect.routing and isinstance(self.mlp, MoE):
      record.update(self.mlp.routing(mlp_in))
    if collect is not None and collect.residual:
      record["residual"] = h
    return h, cache, record
