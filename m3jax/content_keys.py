"""What identifies a prompt position's content for cache reuse (m3jax.conversation, the engine's prefix cache).

A text position is its token id (>= 0). An image / video placeholder position of a multimodal prompt stands for a
vision feature, not for its id: its key is a fingerprint of its embedding row (< 0), so the same placeholder ids
with another image behind them never match a cached position, and the same image does (its rows are the same).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_FINGERPRINT_DIMS = 4  # random projections of a placeholder's embedding row


def media_ids(model) -> np.ndarray:
  """int64 [n]: the model config's image and video placeholder ids (whether or not a vision tower is built)."""
  media = (model.config.image_token_id, model.config.video_token_id)
  return np.asarray([t for t in media if t is not None], np.int64)


def content_keys(ids: Sequence[int], prompt_embeds: jax.Array | np.ndarray | None, placeholder_ids: np.ndarray
                 ) -> list[int]:
  """One key per position of ``ids``: the id itself, or, at a placeholder (an id in ``placeholder_ids``) when
  ``prompt_embeds`` [1, len(ids), H] are given, a fingerprint of its embedding row (a negative int64): a few fixed
  random projections, computed on the device, hashed on the host with the placeholder id."""
  keys = list(ids)
  if prompt_embeds is None or not placeholder_ids.size:
    return keys
  where = np.flatnonzero(np.isin(np.asarray(ids, np.int64), placeholder_ids))
  if not where.size:
    return keys
  projections = np.asarray(_fingerprints(jnp.asarray(prompt_embeds)[0], jnp.asarray(where, jnp.int32),
                                         dims=_FINGERPRINT_DIMS))
  for t, row in zip(where.tolist(), projections):
    digest = hashlib.blake2b(row.tobytes() + int(ids[t]).to_bytes(8, "little"), digest_size=8).digest()
    keys[t] = -1 - (int.from_bytes(digest, "little") >> 1)
  return keys


@functools.partial(jax.jit, static_argnames=("dims",))
def _fingerprints(embeds: jax.Array, rows: jax.Array, *, dims: int) -> jax.Array:
  """embeds [S, H], rows int32 [n] -> fp32 [n, dims]: each row projected on ``dims`` fixed random directions."""
  directions = jax.random.normal(jax.random.key(0x5EED), (embeds.shape[-1], dims), jnp.float32)
  return jnp.dot(embeds[rows].astype(jnp.float32), directions, precision=jax.lax.Precision.HIGHEST)
