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
  alignment_target sparse layers  fp32  [B, S, Hi, nb]  ``indexer_alignment``: dense causal attention mass per
                                                        key block, summed over each KV group's heads and
                                                        divided by their number (sums to 1 per row); no gradient
  alignment_scores sparse layers  fp32  [B, S, Hi, nb]  ``indexer_alignment``: the indexer's block-max scores
                                                        computed from the layer input with its gradient stopped
                                                        (-inf = not visible): gradients reach the indexer only
Sk is the key length (the cache length when a cache is used); nb = ceil(Sk / index_block_size).

``selection_locality`` summarises recorded ``block_ids`` in the terms that bound the sparse attention
kernel's prefill speed (BENCHMARKS.md, "Sparse prefill against selection locality").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.reference import selected_key_mask


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collect:
  """What a forward pass records (see the module docstring for names and shapes)."""

  block_ids: bool = False
  block_scores: bool = False
  routing: bool = False
  residual: bool = False
  indexer_alignment: bool = False  # alignment_target / alignment_scores (m3jax.training.indexer_alignment_loss)
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


def block_attention_mass(q: jax.Array, k: jax.Array, positions: jax.Array, scale: float, block_size: int
                         ) -> jax.Array:
  """Dense causal attention mass per key block and KV group: fp32 [B, Q, Nkv, nb], nb = ceil(Sk / block_size).

  The softmax probabilities of queries q [B, Q, Nq, D] over keys k [B, Sk, Nkv, D] (key slot j visible iff
  j <= position), summed over each key block and over the Nq / Nkv query heads of a group, divided by that
  head count: each (query, group) row sums to 1. What the lightning indexer of group g should predict.
  """
  b, nq_len, nq, _ = q.shape
  sk, nkv = k.shape[1], k.shape[2]
  nb = -(-sk // block_size)
  probs = attention_probs(q, k, positions, scale)  # [B, Nq, Q, Sk]
  probs = jnp.pad(probs, [(0, 0)] * 3 + [(0, nb * block_size - sk)])
  per_block = probs.reshape(b, nkv, nq // nkv, nq_len, nb, block_size).sum(axis=(2, 5))  # [B, Nkv, Q, nb]
  return jnp.transpose(per_block, (0, 2, 1, 3)) / (nq // nkv)


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


def selection_locality(block_ids, positions, tile_sizes: tuple[int, ...] = (4, 8)) -> dict[int, dict[str, float]]:
  """How much the block selections of adjacent queries overlap, per kernel tile size.

  The sparse attention prefill kernel gives each (tile of Q consecutive queries, KV group) one walk over
  the union of the Q queries' selected blocks, and every union entry costs the wgmma work of all Q
  queries (a warpgroup's 64 rows are 4 queries x 16 heads; the warp-specialized kernel streams an
  8-query union to two such warpgroups). So the attended share of that work is
  selected / (Q x union). With M3's top-16 the H200 passes 60 % of cuDNN's dense-causal rate when the
  mean 4-query union is <= ~21 blocks at 32K tokens (~23 at 128K): BENCHMARKS.md, "Sparse prefill
  against selection locality".

  Args:
    block_ids: int [B, S, G, T] selected blocks (-1 = empty slot), e.g. ``intermediates[l]["block_ids"]``.
    positions: int [B, S] query positions (-1 = padding query, ignored).
    tile_sizes: the Q values to report.

  Returns:
    {Q: {"mean_selected": selected blocks per (query, group), "mean_union": union length per (tile, group)
    over tiles with a real query, "row_efficiency": selected / (Q x union) summed over all tiles}}.
  """
  ids = np.asarray(block_ids)
  pos = np.asarray(positions)
  if ids.ndim != 4 or pos.shape != ids.shape[:2]:
    raise ValueError(f"block_ids must be [B, S, G, T] and positions [B, S]; got {ids.shape} and {pos.shape}")
  ids = np.where(pos[:, :, None, None] >= 0, ids, -1)
  b, s, g, t = ids.shape
  mean_selected = float((ids >= 0).sum(-1)[pos >= 0].mean())
  out = {}
  for q in tile_sizes:
    if q < 1:
      raise ValueError(f"tile sizes must be >= 1, got {tile_sizes}")
    pad = -(-s // q) * q - s
    tiles = np.pad(ids, [(0, 0), (0, pad), (0, 0), (0, 0)], constant_values=-1)
    tiles = np.moveaxis(tiles.reshape(b, -1, q, g, t), 3, 2).reshape(b, -1, g, q * t)
    srt = np.sort(tiles, axis=-1)
    distinct = (srt >= 0) & np.concatenate([np.ones_like(srt[..., :1], bool), srt[..., 1:] != srt[..., :-1]], -1)
    union = distinct.sum(-1)
    selected = (tiles >= 0).sum(-1)
    live = selected > 0
    if not live.any():
      raise ValueError("block_ids select no block for any real query")
    out[q] = {
        "mean_selected": mean_selected,
        "mean_union": float(union[live].mean()),
        "row_efficiency": float(selected.sum() / (q * union.sum())),
    }
  return out
