"""M3 attention (M3_SPEC §2.3, §3): per-head Gemma QK-norm, partial NeoX RoPE, GQA; dense causal on
"full" layers, lightning indexer + block-sparse attention on "sparse" layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax.cache import LayerCache, PagedLayerCache
from m3jax.config import TextConfig
from m3jax.layers.norms import RMSNorm
from m3jax.layers.fused_quantized import FusedQuantizedWeights, fuse_quantized, project_fused_quantized
from m3jax.layers.params import make_param
from m3jax.layers.quantized import is_quantized, linear
from m3jax.layers.rope import apply_partial_rope
from m3jax.parallel.projection import FusedWeights, fuse_weights, fused_projection, project_fused
from m3jax.ops import attention as attention_ops
from m3jax.ops import indexer as indexer_ops
from m3jax.ops.dispatch import KernelChoice
from m3jax.research import Collect, attention_probs, block_attention_mass
from m3jax.sharding import constrain, head_replication
from pallas_kernels._chunking import chunked_over_queries
from pallas_kernels.indexer.reference import index_block_scores_reference


class Indexer(nnx.Module):
  """Lightning-indexer projections: Hi query heads and one shared key head, Gemma-normed, RoPE'd.

  No value branch and no per-head weights (M3_SPEC §3.1).
  """

  def __init__(self, cfg: TextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    h, hi, di = cfg.hidden_size, cfg.index_num_heads, cfg.index_head_dim
    self.q_proj = make_param(rngs, (h, hi, di), dtype, (ax.EMBED, ax.IDX_HEADS, ax.IDX_DIM))
    self.k_proj = make_param(rngs, (h, di), dtype, (ax.EMBED, ax.IDX_DIM))
    self.q_norm = RMSNorm(di, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.k_norm = RMSNorm(di, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

  def projection_weights(self) -> tuple[list[jax.Array], list[tuple[str, ...]]]:
    """The query [H, Hi, Di] and key [H, 1, Di] projection weights and their logical axes (fused_projection)."""
    return ([self.q_proj[...], self.k_proj[...][:, None, :]],
            [(ax.EMBED, ax.IDX_HEADS, ax.IDX_DIM), (ax.EMBED, None, ax.IDX_DIM)])

  def project_each(self, x: jax.Array, kernels) -> list[jax.Array]:
    """x [B,S,H] -> index q [B,S,Hi,Di] and k [B,S,1,Di], one projection each (weights kept quantized)."""
    q = linear(x, self.q_proj, "bsh,hnd->bsnd", kernels=kernels)
    k = linear(x, self.k_proj, "bsh,hd->bsd", kernels=kernels)
    return [q, k[:, :, None, :]]

  def finish(self, q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Projected q [B,S,Hi,Di], k [B,S,1,Di] -> idx_q [B,S,Hi,Di], idx_k [B,S,Di] (post-norm, post-RoPE)."""
    idx_q = apply_partial_rope(self.q_norm(q), cos, sin)
    idx_k = apply_partial_rope(self.k_norm(k), cos, sin)[:, :, 0, :]
    return idx_q, idx_k


class Attention(nnx.Module):
  """Self-attention of one decoder layer; ``sparse`` adds the indexer and block-sparse attention."""

  def __init__(self, cfg: TextConfig, *, sparse: bool, dtype: jnp.dtype, kernels: KernelChoice,
               rngs: nnx.Rngs | None):
    h, nq, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.head_dim = d
    self.kernels = kernels
    self.block_size = cfg.index_block_size
    self.topk = cfg.index_topk_blocks
    self.local_blocks = cfg.index_local_blocks
    self.init_blocks = cfg.index_init_blocks
    self.q_proj = make_param(rngs, (h, nq, d), dtype, (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM))
    self.k_proj = make_param(rngs, (h, nkv, d), dtype, (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
    self.v_proj = make_param(rngs, (h, nkv, d), dtype, (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM))
    self.o_proj = make_param(rngs, (nq, d, h), dtype, (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED))
    self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs) if sparse else None

  def _projection_weights(self) -> tuple[list[jax.Array], list[tuple[str | None, ...]]]:
    """q, k, v (and index q, k on sparse layers) weights [H, N_i, D_i] and their logical axes."""
    weights = [self.q_proj[...], self.k_proj[...], self.v_proj[...]]
    axes = [(ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM)] + [(ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM)] * 2
    if self.indexer is not None:
      index_weights, index_axes = self.indexer.projection_weights()
      weights, axes = weights + index_weights, axes + index_axes
    return weights, axes

  def _projection_params(self) -> list:
    """The q, k, v (and index q, k) parameters or ``QuantizedLinear`` modules, in projection order."""
    index = [] if self.indexer is None else [self.indexer.q_proj, self.indexer.k_proj]
    return [self.q_proj, self.k_proj, self.v_proj, *index]

  def _quantized_projections(self) -> bool:
    """Whether any input projection is kept in fp8 (the layer then projects with each weight on its own, or
    with ``fused_weights()`` in a decode loop)."""
    return is_quantized(*self._projection_params())

  def _project_each(self, x: jax.Array) -> list[jax.Array]:
    """q [B,S,Nq,D], k, v [B,S,Nkv,D] (and index q, k) with one projection per weight."""
    out = [linear(x, w, "bsh,hnd->bsnd", kernels=self.kernels) for w in (self.q_proj, self.k_proj, self.v_proj)]
    return out + ([] if self.indexer is None else self.indexer.project_each(x, self.kernels))

  def fused_weights(self) -> FusedWeights | FusedQuantizedWeights | None:
    """This layer's projection weights as one fused weight, to build once before a decode loop and pass as
    ``projection`` on every step: bf16 / fp32 weights concatenated (``m3jax.parallel.projection``), fp8 ones
    stacked with their scales (``m3jax.layers.fused_quantized``). None where the plan splits the hidden axis,
    or for fp8 weights that do not fuse (mixed with float ones, or under a multi-device plan): the layer then
    projects with each weight on its own."""
    if self._quantized_projections():
      return fuse_quantized(self._projection_params())
    return fuse_weights(*self._projection_weights())

  def __call__(
      self, x: jax.Array, *, positions: jax.Array, cos: jax.Array, sin: jax.Array, cache: LayerCache | None,
      collect: Collect | None = None, projection: FusedWeights | None = None, dense_attention: bool = False,
  ) -> tuple[jax.Array, LayerCache | None, dict[str, jax.Array]]:
    """x [B,S,H], positions int32 [B,S], cos/sin fp32 [B,S,rotary] -> ([B,S,H], updated cache, record).

    Without a cache the keys are this call's tokens, so positions must be 0..S-1 in every row. With a
    cache, new K/V (and index keys) are written at ``positions`` and attention reads the whole cache (a
    ``PagedLayerCache`` through its page table).
    ``record`` holds what ``collect`` asks for (m3jax.research); empty by default. ``projection``: this
    layer's ``fused_weights()``, built once outside a decode loop; without it bf16 / fp32 weights are fused here
    and fp8 ones project one by one (a prefill is compute-bound: a per-call copy of the fp8 weights would not pay).
    ``dense_attention``: a sparse layer attends densely (causal, no selection): the dense warm-up phase of
    indexer training (m3jax.training); the index keys are still written to a cache.
    """
    # Sequence parallelism: gather the token-sharded residual to this layer's query-token layout.
    x = constrain(x, (ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_EMBED))
    if isinstance(projection, FusedQuantizedWeights):
      q, k, v, *index = project_fused_quantized(x, projection, kernels=self.kernels)
    elif projection is None and self._quantized_projections():
      q, k, v, *index = self._project_each(x)
    elif projection is None:
      q, k, v, *index = fused_projection(x, *self._projection_weights())
    else:
      q, k, v, *index = project_fused(x, projection)
    q = apply_partial_rope(self.q_norm(q), cos, sin)
    k = apply_partial_rope(self.k_norm(k), cos, sin)
    idx_q = idx_k = None
    if self.indexer is not None:
      idx_q, idx_k = self.indexer.finish(*index, cos, sin)
    r = head_replication(k.shape[2])  # > 1 only with more tensor ranks than KV heads (vLLM's replication)
    if r > 1:  # KV group g becomes heads g*r .. g*r+r-1: same GQA grouping, one head (or more) per rank
      k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
      idx_q = None if idx_q is None else jnp.repeat(idx_q, r, axis=2)
    page_table = None
    if cache is not None:
      cache = cache.write(positions, k, v, idx_k)
      k, v, idx_k = cache.k, cache.v, cache.idx_k
      if isinstance(cache, PagedLayerCache):
        if collect is not None:  # the research records read rows
          rows = cache.contiguous()
          k, v, idx_k = rows.k, rows.v, rows.idx_k
        else:
          page_table = cache.page_table
    scale = self.head_dim ** -0.5
    block_ids = None
    if self.indexer is None or dense_attention:
      out = attention_ops.causal_attention(q, k, v, positions, scale=scale, kernels=self.kernels,
                                           page_table=page_table)
    else:
      block_ids = indexer_ops.indexer_topk(
          idx_q, idx_k, positions, block_size=self.block_size, topk=self.topk,
          local_blocks=self.local_blocks, init_blocks=self.init_blocks, kernels=self.kernels, page_table=page_table)
      out = attention_ops.sparse_attention(q, k, v, block_ids, positions, block_size=self.block_size,
                                           scale=scale, kernels=self.kernels, page_table=page_table)
    record = {} if collect is None else self._record(
        collect, q, k[:, :, ::r], None if idx_q is None else idx_q[:, :, ::r], idx_k, positions,
        None if block_ids is None else block_ids[:, :, ::r], scale)
    if collect is not None and collect.indexer_alignment and self.indexer is not None:
      record.update(self._alignment_record(x, q, k[:, :, ::r], positions, cos, sin, scale))
    return linear(out, self.o_proj, "bsnd,ndh->bsh", kernels=self.kernels), cache, record

  def _alignment_record(self, x, q, k, positions, cos, sin, scale) -> dict[str, jax.Array]:
    """The indexer-alignment pair of this sparse layer (m3jax.research documents them): the dense attention's
    block mass (no gradient) and the indexer's block scores from the input with its gradient stopped, so that
    an alignment loss trains the indexer's own weights and nothing of the main model. [B, S, Hi, nb] each.
    With a cache, x must be the cache's only tokens (positions 0..S-1): the indexer keys come from x."""
    target = chunked_over_queries(
        lambda qc, pc: block_attention_mass(qc, jax.lax.stop_gradient(k), pc, scale, self.block_size), 256,
        jax.lax.stop_gradient(q), positions)
    x_in = jax.lax.stop_gradient(x)
    iq, ik = self.indexer.project_each(x_in, self.kernels)  # fp8 weights stay quantized (the reference dequantizes)
    idx_q, idx_k = self.indexer.finish(iq, ik, cos, sin)
    scores = chunked_over_queries(
        lambda qc, pc: index_block_scores_reference(qc, idx_k, pc, block_size=self.block_size), 256,
        idx_q, positions)
    return {"alignment_target": jax.lax.stop_gradient(target), "alignment_scores": scores}

  def _record(self, collect: Collect, q, k, idx_q, idx_k, positions, block_ids, scale) -> dict[str, jax.Array]:
    """The research intermediates of this layer (m3jax.research documents names and shapes)."""
    record: dict[str, jax.Array] = {}
    if block_ids is not None and collect.block_ids:
      record["block_ids"] = block_ids
    if block_ids is not None and collect.block_scores:
      record["block_scores"] = chunked_over_queries(
          lambda qc, pc: index_block_scores_reference(qc, idx_k, pc, block_size=self.block_size), 256,
          idx_q, positions)
    if collect.attention_queries is not None:
      start, stop = collect.attention_queries
      if stop > q.shape[1]:
        raise ValueError(f"attention_queries {collect.attention_queries} beyond the {q.shape[1]} queries of this call")
      qs, ps = q[:, start:stop], positions[:, start:stop]
      if block_ids is None:
        record["attn_probs"] = attention_probs(qs, k, ps, scale)
      else:
        record["attn_probs"] = attention_probs(qs, k, ps, scale, block_ids[:, start:stop], self.block_size)
        record["dense_probs"] = attention_probs(qs, k, ps, scale)
    return record
