"""Pure-jnp reference attention for M3: dense causal GQA and block-sparse GQA.

Cache convention shared by every attention op: key/value slot ``j`` of sequence ``b`` holds the token at
position ``j`` of that sequence (caches are anchored to each sequence's own positions, never left-padded).
A query at position ``p`` may see key slot ``j`` iff ``j <= p``. Slots past a sequence's real length are
therefore never visible to its real queries, whatever they contain.

Both functions process queries in chunks, so memory is O(chunk x Sk) per head, never O(Sq x Sk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._chunking import chunked_over_queries as _chunked_over_queries
from pallas_kernels._paging import check_page_table, gather_pages

_NEG_INF = float("-inf")


def _masked_gqa_softmax_attention(q, k, v, allowed, scale):
  """q [B,C,Nq,D], k/v [B,Sk,Nkv,D], allowed bool [B,C,Nkv,Sk] -> [B,C,Nq,D] in q.dtype.

  Logits and softmax in fp32; probabilities are cast to v.dtype before P.V (fp32 accumulation). A query
  row with no allowed key (only padding rows can have one) returns zeros.
  """
  b, c, nq, d = q.shape
  nkv = k.shape[2]
  qg = q.reshape(b, c, nkv, nq // nkv, d)
  logits = jnp.einsum("bcgnd,bsgd->bgncs", qg, k, preferred_element_type=jnp.float32) * scale
  mask = jnp.transpose(allowed, (0, 2, 1, 3))[:, :, None]  # [B, Nkv, 1, C, Sk]
  logits = jnp.where(mask, logits, _NEG_INF)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.exp(logits - row_max)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bgncs,bsgd->bcgnd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, c, nq, d).astype(q.dtype)


def _read_pages(k, v, page_table, batch):
  """k, v as contiguous rows [B, Sk, Nkv, D]: gathered through page_table when they are pools."""
  if page_table is None:
    return k, v
  check_page_table(k, page_table, batch)
  return gather_pages(k, page_table), gather_pages(v, page_table)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def causal_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    scale: float,
    chunk_size: int = 512,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Dense causal GQA attention.

  Args:
    q: [B, Sq, Nq, D] queries (post-norm, post-RoPE).
    k, v: [B, Sk, Nkv, D] keys/values; slot j holds position j. Nq % Nkv == 0; query head n reads KV
      head n // (Nq // Nkv).
    q_positions: int32 [B, Sq], each query's position in its own sequence.
    scale: softmax scale (D ** -0.5 for M3).
    chunk_size: queries per chunk (memory knob only; results do not depend on it).
    page_table: int32 [B, n] when k, v are pools of pages [P, page, Nkv, D] (pallas_kernels._paging): sequence
      b's keys are its pages in table order (Sk = n * page).

  Returns:
    [B, Sq, Nq, D] in q.dtype.
  """
  k, v = _read_pages(k, v, page_table, q.shape[0])
  sk = k.shape[1]
  key_pos = jnp.arange(sk, dtype=jnp.int32)

  def chunk_fn(qc, pc):
    allowed = key_pos[None, None, None, :] <= pc[:, :, None, None]  # [B, C, 1, Sk]
    allowed = jnp.broadcast_to(allowed, (qc.shape[0], qc.shape[1], k.shape[2], sk))
    return _masked_gqa_softmax_attention(qc, k, v, allowed, scale)

  return _chunked_over_queries(chunk_fn, chunk_size, q, q_positions.astype(jnp.int32))


def selected_key_mask(block_ids: jax.Array, q_positions: jax.Array, num_keys: int, block_size: int) -> jax.Array:
  """Token-level visibility from a block selection.

  Args:
    block_ids: int32 [B, C, G, T], selected key-block ids per query and KV group, -1 = empty slot.
    q_positions: int32 [B, C].
    num_keys: Sk.
    block_size: keys per block.

  Returns:
    bool [B, C, G, Sk]: key j visible iff block j // block_size is selected and j <= position.
  """
  num_blocks = -(-num_keys // block_size)
  safe = jnp.where(block_ids < 0, num_blocks, block_ids)
  hit = jax.nn.one_hot(safe, num_blocks + 1, dtype=jnp.bool_).any(axis=-2)[..., :num_blocks]  # [B,C,G,nb]
  key_pos = jnp.arange(num_keys, dtype=jnp.int32)
  in_block = hit[..., key_pos // block_size]
  causal = key_pos[None, None, None, :] <= q_positions[:, :, None, None]
  return in_block & causal


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "chunk_size"))
def sparse_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_ids: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    scale: float,
    chunk_size: int = 256,
    page_table: jax.Array | None = None,
) -> jax.Array:
  """Block-sparse GQA attention (M3 "MSA" attend step).

  Query (b, p) of head n attends to key slots j with ``j // block_size`` in
  ``block_ids[b, p, n // (Nq // Nkv)]`` and ``j <= q_positions[b, p]`` (token-level causal mask inside
  the selected blocks). Softmax in fp32; -1 slots are ignored; duplicate ids are not allowed.

  Args:
    q: [B, Sq, Nq, D]; k, v: [B, Sk, Nkv, D] (slot j holds position j).
    block_ids: int32 [B, Sq, Nkv, T] from the indexer (left-packed, -1 padded).
    q_positions: int32 [B, Sq].
    block_size: keys per block (128 for M3).
    scale: softmax scale.
    chunk_size: queries per chunk (memory knob only).
    page_table: as in causal_attention_reference (block i of sequence b is then its i-th page).

  Returns:
    [B, Sq, Nq, D] in q.dtype.
  """
  k, v = _read_pages(k, v, page_table, q.shape[0])
  sk = k.shape[1]

  def chunk_fn(qc, ids, pc):
    allowed = selected_key_mask(ids, pc, sk, block_size)
    return _masked_gqa_softmax_attention(qc, k, v, allowed, scale)

  return _chunked_over_queries(
      chunk_fn, chunk_size, q, block_ids.astype(jnp.int32), q_positions.astype(jnp.int32)
  )
