"""Per-layer decode caches: functional pytrees, anchored to each sequence's own positions.

Slot j of sequence b holds the token at position j of that sequence (never left-padded), so block ids of
the sparse layers are position // block_size for every sequence independently. Writes at positions beyond
the cache length are dropped by the scatter; callers validate lengths before any compute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m3jax import logical_axes as ax
from m3jax.sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """K/V (post-norm, post-RoPE) [B, S_max, Nkv, D]; sparse layers add index keys idx_k [B, S_max, Di]."""

  k: jax.Array
  v: jax.Array
  idx_k: jax.Array | None = None

  LOGICAL_AXES = {
      "k": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_HEADS, ax.CACHE_DIM),
      "v": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_HEADS, ax.CACHE_DIM),
      "idx_k": (ax.CACHE_BATCH, ax.CACHE_SEQ, ax.CACHE_DIM),
  }

  @property
  def max_length(self) -> int:
    return self.k.shape[1]

  @classmethod
  def zeros(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, index_head_dim: int | None,
            dtype: jnp.dtype) -> "LayerCache":
    kv = jnp.zeros((batch, max_length, num_kv_heads, head_dim), dtype)
    idx = None if index_head_dim is None else jnp.zeros((batch, max_length, index_head_dim), dtype)
    return cls(k=kv, v=kv, idx_k=idx).constrained()

  def constrained(self) -> "LayerCache":
    """This cache laid out by the active sharding plan (``LOGICAL_AXES``; m3jax.sharding); identity without."""
    idx = None if self.idx_k is None else constrain(self.idx_k, self.LOGICAL_AXES["idx_k"])
    return LayerCache(k=constrain(self.k, self.LOGICAL_AXES["k"]), v=constrain(self.v, self.LOGICAL_AXES["v"]),
                      idx_k=idx)

  def write(self, positions: jax.Array, k: jax.Array, v: jax.Array, idx_k: jax.Array | None) -> "LayerCache":
    """Stores new entries at [b, positions[b, s]]: k/v [B, S, Nkv, D], idx_k [B, S, Di]."""
    b = jnp.arange(positions.shape[0])[:, None]
    new_k = self.k.at[b, positions].set(k.astype(self.k.dtype), mode="drop")
    new_v = self.v.at[b, positions].set(v.astype(self.v.dtype), mode="drop")
    new_idx = self.idx_k
    if self.idx_k is not None:
      if idx_k is None:
        raise ValueError("this layer's cache holds index keys; idx_k must be given")
      new_idx = self.idx_k.at[b, positions].set(idx_k.astype(self.idx_k.dtype), mode="drop")
    return LayerCache(k=new_k, v=new_v, idx_k=new_idx).constrained()
