"""M3's multi-token-prediction (MTP) module (M3_SPEC §8): a draft head for speculative decoding.

At target position t it reads the next token x_{t+1} and the target's final-normed hidden state h_t, and
predicts x_{t+2}:

    e   = embed(x_{t+1}), zeroed at position 0
    u   = eh_proj([enorm(e) ; hnorm(h_t)])              eh_proj: [2H] -> [H], no bias
    out = DecoderLayer(u)                                a full sparse-attention + MoE layer, residual included
    logits = lm_head(final_norm(out))                    embedding table and LM head shared with the target

``out`` (not final-normed) is what a further draft step reads as its "hidden state" (vLLM's proposer feeds the
module's own output back). The layer has its own KV / index-key cache, anchored to the target's positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.cache import LayerCache
from m3jax.config import TextConfig
from m3jax.layers.decoder import DecodeWeights, DecoderLayer
from m3jax.layers.norms import RMSNorm
from m3jax.layers.params import make_param, project
from m3jax.layers.rope import rope_cos_sin
from m3jax.ops.dispatch import KernelChoice
from m3jax.research import Collect


class MTPLayer(nnx.Module):
  """One MTP module: ``enorm``, ``hnorm``, ``eh_proj`` [2H, H] (rows: enorm(e) first, then hnorm(h)), a sparse +
  MoE ``layer`` and its ``final_norm``."""

  def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, kernels: KernelChoice, rngs: nnx.Rngs | None):
    h = cfg.hidden_size
    self.enorm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.hnorm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.eh_proj = make_param(rngs, (2 * h, h), dtype, (None, ax.EMBED))
    self.layer = DecoderLayer(cfg, 0, dtype=dtype, kernels=kernels, rngs=rngs, attention_type="sparse",
                              mlp_type="moe")
    self.final_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta

  def __call__(self, embeds: jax.Array, prev_hidden: jax.Array, *, positions: jax.Array, cache: LayerCache | None,
               prepared: DecodeWeights | None = None, collect: Collect | None = None,
               dense_attention: bool = False) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]:
    """embeds [B, S, H] (the embeddings of x_{t+1}), prev_hidden [B, S, H] (h_t), positions int32 [B, S] (t) ->
    (out [B, S, H], the module's updated cache, the layer's research record (empty unless ``collect``)).
    Apply ``final_norm`` and the LM head to ``out`` for logits. ``dense_attention``: DecoderLayer's."""
    if embeds.shape != prev_hidden.shape:
      raise ValueError(f"MTP token embeddings {embeds.shape} and previous hidden states {prev_hidden.shape} differ")
    dtype = self.eh_proj[...].dtype
    e = jnp.where((positions == 0)[..., None], jnp.zeros((), embeds.dtype), embeds)
    joined = jnp.concatenate([self.enorm(e.astype(dtype)), self.hnorm(prev_hidden.astype(dtype))], axis=-1)
    u = project("bsk,kh->bsh", joined, self.eh_proj[...])
    cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
    out, cache, record = self.layer(u, positions=positions, cos=cos, sin=sin, cache=cache, prepared=prepared,
                                    collect=collect, dense_attention=dense_attention)
    return out, cache, record
