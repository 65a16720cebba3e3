"""Vision-tower building blocks (M3_SPEC §7.1-7.2, §7.5): LayerNorm, linear with bias, segment attention,
CLIP MLP, encoder layer. Activations are [S, L, D] (segments x slots x channels, see ``grid.VisionLayout``).

Statistics, softmax, GELU and bias adds run in fp32; weights and activations stay in the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.layers.params import make_param, project
from m3jax.layers.rope import apply_partial_rope
from pallas_kernels._chunking import chunked_over_queries

# Logical axis names of the vision parameters (no sharding rule maps them: the tower is replicated).
V_EMBED = "vision_embed"
V_HEADS = "vision_heads"
V_HEAD_DIM = "vision_head_dim"
V_MLP = "vision_mlp"
V_PATCH = "vision_patch"
V_NORM = "vision_norm"

_NEG_INF = float("-inf")


def _precision(dtype) -> jax.lax.Precision | None:
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def gelu(x: jax.Array) -> jax.Array:
  """Exact (erf) GELU computed in fp32, cast back to x.dtype."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class LayerNorm(nnx.Module):
  """LayerNorm with weight and bias over the last axis; fp32 statistics, one cast back."""

  def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype), out_sharding=(V_NORM,), eager_sharding=False)
    self.bias = make_param(rngs, (dim,), dtype, (V_NORM,), init="zeros")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Module):
  """y = x @ W + b with W stored [in, *out] (checkpoint [out, in] transposed); bias optional."""

  def __init__(self, in_dim: int, out_shape: tuple[int, ...], *, bias: bool, dtype: jnp.dtype,
               rngs: nnx.Rngs | None, axes: tuple[str, ...]):
    self.weight = make_param(rngs, (in_dim, *out_shape), dtype, axes)
    self.bias = make_param(rngs, out_shape, dtype, axes[1:], std=0.02) if bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., in] -> [..., *out] in x.dtype (fp32 accumulation and bias add)."""
    w = self.weight[...]
    out_letters = "opq"[: w.ndim - 1]
    y = project(f"...i,i{out_letters}->...{out_letters}", x, w, out_dtype=jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, *, scale: float,
                      chunk_size: int = 1024) -> jax.Array:
  """Bidirectional attention inside each segment.

  Args:
    q, k, v: [S, L, N, D] (segment, slot, head, channel).
    valid: bool [S, L]; False slots are padding and are never attended to.
    scale: logit scale (head_dim ** -0.5).
    chunk_size: queries per chunk (memory is O(S * N * chunk * L)).

  Returns:
    [S, L, N, D] in q.dtype; rows of padding slots are garbage-free (finite) but meaningless.
  """
  precision = _precision(q.dtype)

  def one_chunk(qc):
    logits = jnp.einsum("scnd,sknd->snck", qc, k, preferred_element_type=jnp.float32,
                        precision=precision) * scale
    logits = jnp.where(valid[:, None, None, :], logits, _NEG_INF)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("snck,sknd->scnd", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=precision)
    return out.astype(q.dtype)

  return chunked_over_queries(one_chunk, chunk_size, q)


class VisionAttention(nnx.Module):
  """q/k/v/out projections with biases, 3-D axial RoPE on q and k, segment attention."""

  def __init__(self, dim: int, num_heads: int, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    hd = dim // num_heads
    self.head_dim = hd
    axes = (V_EMBED, V_HEADS, V_HEAD_DIM)
    self.q_proj = Linear(dim, (num_heads, hd), bias=True, dtype=dtype, rngs=rngs, axes=axes)
    self.k_proj = Linear(dim, (num_heads, hd), bias=True, dtype=dtype, rngs=rngs, axes=axes)
    self.v_proj = Linear(dim, (num_heads, hd), bias=True, dtype=dtype, rngs=rngs, axes=axes)
    self.out_proj = Linear(num_heads * hd, (dim,), bias=True, dtype=dtype, rngs=rngs, axes=(V_HEADS, V_EMBED))

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, valid: jax.Array) -> jax.Array:
    """x [S, L, D], cos/sin fp32 [S, L, R], valid bool [S, L] -> [S, L, D]."""
    q = apply_partial_rope(self.q_proj(x), cos, sin)
    k = apply_partial_rope(self.k_proj(x), cos, sin)
    v = self.v_proj(x)
    out = segment_attention(q, k, v, valid, scale=self.head_dim ** -0.5)
    return self.out_proj(out.reshape(*out.shape[:2], -1))


class VisionMLP(nnx.Module):
  """fc2(gelu(fc1(x))), both with biases."""

  def __init__(self, dim: int, width: int, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
    self.fc1 = Linear(dim, (width,), bias=True, dtype=dtype, rngs=rngs, axes=(V_EMBED, V_MLP))
    self.fc2 = Linear(width, (dim,), bias=True, dtype=dtype, rngs=rngs, axes=(V_MLP, V_EMBED))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(gelu(self.fc1(x)))


class VisionEncoderLayer(nnx.Module):
  """Pre-norm CLIP layer: h += attn(ln1(h)); h += mlp(ln2(h))."""

  def __init__(self, dim: int, num_heads: int, width: int, *, eps: float, dtype: jnp.dtype,
               rngs: nnx.Rngs | None):
    self.norm1 = LayerNorm(dim, eps=eps, dtype=dtype, rngs=rngs)
    self.attn = VisionAttention(dim, num_heads, dtype=dtype, rngs=rngs)
    self.norm2 = LayerNorm(dim, eps=eps, dtype=dtype, rngs=rngs)
    self.mlp = VisionMLP(dim, width, dtype=dtype, rngs=rngs)

  def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array, valid: jax.Array) -> jax.Array:
    """h [S, L, D] -> [S, L, D]."""
    h = h + self.attn(self.norm1(h), cos, sin, valid)
    return h + self.mlp(self.norm2(h))
