"""Pure-jnp reference of M3's lightning indexer (score -> token-causal mask -> block max -> top-k).

Contract (M3_SPEC §3.2-3.3), per sequence b, index head h (= KV group h), query position p:
  score_h(p, j)    = <idx_q_h(p), idx_k(j)> in fp32, no scale, for key slot j <= p; -inf for j > p.
  block_h(p, n)    = max over slots j in block n of score_h(p, j)   (-inf if every key is masked).
  forced blocks    = local: qb - i for i in [0, local_blocks) with qb = p // block_size (those >= 0),
                     init: 0 .. init_blocks - 1 (those <= qb). Forced blocks are always selected.
  selection        = forced blocks + the highest-scoring remaining valid blocks, min(topk, qb + 1) ids in all,
                     left-packed, -1 in the remaining slots, no duplicates. Id order is not part of the
                     contract (this reference sorts by score, descending).
Key slot j holds position j of its own sequence (see pallas_kernels.attention.reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._paging import check_page_table, gather_pages
from pallas_kernels._chunking import chunked_over_queries as _chunked_over_queries

_NEG_INF = float("-inf")


def index_block_scores_reference(
    idx_q: jax.Array, idx_k: jax.Array, q_positions: jax.Array, *, block_size: int
) -> jax.Array:
  """Block-max index scores (materialises [B, Sq, Hi, Sk] scores: use on chunks only).

  Args:
    idx_q: [B, Sq, Hi, Di] index queries (post-norm, post-RoPE).
    idx_k: [B, Sk, Di] index keys (one shared head; post-norm, post-RoPE).
    q_positions: int32 [B, Sq].
    block_size: keys per block.

  Returns:
    fp32 [B, Sq, Hi, nb] with nb = ceil(Sk / block_size); -inf where the block has no visible key.
  """
  b, sq, hi, _ = idx_q.shape
  sk = idx_k.shape[1]
  nb = -(-sk // block_size)
  scores = jnp.einsum(
      "bqhd,bkd->bqhk", idx_q.astype(jnp.float32), idx_k.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
  )
  key_pos = jnp.arange(sk, dtype=jnp.int32)
  future = key_pos[None, None, None, :] > q_positions[:, :, None, None]
  scores = jnp.where(future, _NEG_INF, scores)
  scores = jnp.pad(scores, [(0, 0)] * 3 + [(0, nb * block_size - sk)], constant_values=_NEG_INF)
  return scores.reshape(b, sq, hi, nb, block_size).max(axis=-1)


def select_blocks_reference(
    block_scores: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
) -> jax.Array:
  """Top-k block selection with forced local/init blocks.

  Args:
    block_scores: fp32 [B, Sq, Hi, nb] from index_block_scores (-inf = invalid block).
    q_positions: int32 [B, Sq].
    block_size, topk, local_blocks, init_blocks: see module docstring.

  Returns:
    int32 [B, Sq, Hi, topk], left-packed block ids, -1 padded.
  """
  nb = block_scores.shape[-1]
  scores = jnp.where(jnp.isnan(block_scores), -1e30, block_scores)
  qb = (q_positions // block_size)[:, :, None, None]  # [B, Sq, 1, 1]
  blk = jnp.arange(nb, dtype=jnp.int32)[None, None, None, :]
  valid = blk <= qb
  forced = ((blk > qb - local_blocks) | (blk < init_blocks)) & valid
  scores = jnp.where(forced, jnp.inf, scores)
  scores = jnp.where(valid, scores, _NEG_INF)
  if nb < topk:
    scores = jnp.pad(scores, [(0, 0)] * 3 + [(0, topk - nb)], constant_values=_NEG_INF)
  top_scores, top_ids = jax.lax.top_k(scores, topk)
  return jnp.where(top_scores == _NEG_INF, -1, top_ids).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "chunk_size")
)
def indexer_topk_reference(
    idx_q: jax.Array,
    idx_k: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int = 0,
    chunk_size: int = 256,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Lightning-indexer block selection, processed in query chunks (memory O(chunk x Sk)).

  Args:
    idx_q: [B, Sq, Hi, Di]; idx_k: [B, Sk, Di]; q_positions: int32 [B, Sq].
    block_size, topk, local_blocks, init_blocks: selection parameters (module docstring).
    chunk_size: queries per chunk (memory knob only).
    page_table: int32 [B, n] when idx_k is a pool of pages [P, page, Di] (pallas_kernels._paging): sequence b's
      keys are its pages in table order (Sk = n * page).

  Returns:
    int32 [B, Sq, Hi, topk] selected block ids (left-packed, -1 padded).
  """

  if page_table is not None:
    check_page_table(idx_k, page_table, idx_q.shape[0])
    idx_k = gather_pages(idx_k, page_table)

  def chunk_fn(qc, pc):
    scores = index_block_scores_reference(qc, idx_k, pc, block_size=block_size)
    return select_blocks_reference(
        scores, pc, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks
    )

  return _chunked_over_queries(chunk_fn, chunk_size, idx_q, q_positions.astype(jnp.int32))
