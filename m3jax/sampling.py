"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus); seeded and reproducible."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """temperature 0 = greedy. top_k None/0 = no top-k cut; top_p None/1.0 = no nucleus cut."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k is not None and self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """logits fp32 [B, V] -> int32 token ids [B]."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The logits ``sample`` draws from when not greedy: fp32 [B, V] divided by the temperature, with the tokens
  outside top-k / top-p set to the lowest float (softmax of these is the sampling distribution). Any leading
  shape [..., V]."""
  if params.greedy:
    raise ValueError("greedy sampling (temperature 0) has no sampling distribution")
  logits = logits.astype(jnp.float32) / params.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if params.top_k:
    k = min(params.top_k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if params.top_p is not None and params.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_idx = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    logits = jnp.where(logits < cutoff, neg_inf, logits)
  return logits
