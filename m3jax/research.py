"""Research hooks: what to record from a forward pass, and sparse-vs-dense attention comparisons.

``model.forward(input_ids, collect=Collect(...))`` returns ``ForwardOutput.intermediates``: a tuple with one
dict per layer, holding only what was asked for (all jit-compatible; nothing is recorded by default):

  block_ids       sparse layers   int32 [B, S, Hi, T]   selected key blocks per KV group (-1 = empty slot)
  block_scores    sparse layers   fp32  [B, S, Hi, nb]  indexer block-max scores (-inf = not visible)
  router_logits   MoE layers      fp32  [B, S, E]
  expert_ids      MoE layers      int32 [B, S, K]       chosen experts (selection uses the correction bias)
  expert_weights  MoE layers      fp32  [B, S, K]       renormalised routing weights (before routed scaling)
  residual        every layer     [B, S, H]             residual stream after the layer
  attn_probs      every layer     fp32  [B, Nq, Q, Sk]  attention probabilities of queries
                                                        [start, stop) as the layer computes them (sparse
                                                        layers: restricted to the selected blocks)
  dense_probs     sparse layers   fp32  [B, Nq, Q, Sk]  dense causal probabilities of the same queries
Sk is the key length (the cache length when a cache is used).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import selected_key_mask


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collect:
  """What a forward pass records (see the module docstring for names and shapes)."""

  block_ids: bool = False
  block_scores: bool = False
  routing: bool = False
  residual: bool = False
  attention_queries: tuple[int, int] | None = None  # [start, stop) query indices for attn_probs / dense_probs

  def __post_init__(self):
    if self.attention_queries is not None:
      start, stop = self.attention_queries
      if not 0 <= start < stop:
        raise ValueError(f"attention_queries must be [start, stop) with 0 <= start < stop, got {(start, stop)}")


def attention_probs(q: jax.Array, k: jax.Array, positions: jax.Array, scale: float,
                    block_ids: jax.Array | None = None, block_size: int = 0) -> jax.Array:
  """Softmax probabilities fp32 [B, Nq, Q, Sk] of queries q [B, Q, Nq, D] over keys k [B, Sk, Nkv, D].

  Causal by position (key slot j visible iff j <= position); with block_ids [B, Q, Nkv, T] also restricted to
  the selected blocks.
  """
  b, nq_len, nq, d = q.shape
  sk, nkv = k.shape[1], k.shape[2]
  kk = jnp.repeat(k, nq // nkv, axis=2)
  logits = jnp.einsum("bqnd,bsnd->bnqs", q.astype(jnp.float32), kk.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  if block_ids is None:
    allowed = jnp.arange(sk)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, Q, Sk]
  else:
    mask = selected_key_mask(block_ids, positions, sk, block_size)  # [B, Q, Nkv, Sk]
    allowed = jnp.repeat(jnp.transpose(mask, (0, 2, 1, 3)), nq // nkv, axis=1)
  logits = jnp.where(allowed, logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


def mass_outside_selection(intermediates, layer: int) -> jax.Array:
  """Dense-attention probability mass that the sparse selection drops: fp32 [B, Nq, Q] for one sparse layer.

  1 - sum of the dense causal probabilities over the keys the selection keeps (needs ``Collect`` with
  ``attention_queries``; the layer must be sparse). 0 means the sparse layer saw all the mass.
  """
  rec = intermediates[layer]
  if "dense_probs" not in rec:
    raise ValueError(f"layer {layer} has no dense_probs: it is not sparse, or attention_queries was not collected")
  kept = rec["attn_probs"] > 0
  return 1.0 - jnp.sum(jnp.where(kept, rec["dense_probs"], 0.0), axis=-1)
