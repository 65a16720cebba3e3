"""Query-chunking helper shared by the references (bounded memory for long sequences)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_over_queries(fn, chunk_size: int, *arrays_with_q_axis):
  """Applies ``fn`` to query chunks (axis 1 of every array) with lax.map and concatenates the results.

  The query axis is padded to a multiple of ``chunk_size``; padded rows are computed and dropped.
  """
  sq = arrays_with_q_axis[0].shape[1]
  chunk = min(chunk_size, sq)
  n_chunks = -(-sq // chunk)
  pad = n_chunks * chunk - sq

  def split(a):
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    a = a.reshape(a.shape[0], n_chunks, chunk, *a.shape[2:])
    return jnp.moveaxis(a, 1, 0)

  out = jax.lax.map(lambda args: fn(*args), tuple(split(a) for a in arrays_with_q_axis))
  out = jnp.moveaxis(out, 0, 1)
  out = out.reshape(out.shape[0], n_chunks * chunk, *out.shape[3:])
  return out[:, :sq]
