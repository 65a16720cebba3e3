"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus); seeded and reproducible."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from m3jax.token_ids import is_token_id

# The engine and the sampling kernels hold the parameters as int32 / float32 arrays.
_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """temperature 0 = greedy. top_k None/0 = no top-k cut; top_p None/1.0 = no nucleus cut."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) or not (
        0 <= self.temperature < math.inf):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if self.temperature > _FLOAT32_MAX:
      raise ValueError(f"temperature must be a finite float32 (<= {_FLOAT32_MAX:.4g}), got {self.temperature!r}")
    if self.top_k is not None and (not is_token_id(self.top_k) or not 0 <= self.top_k <= _INT32_MAX):
      raise ValueError(f"top_k must be an integer >= 0 and <= {_INT32_MAX} (int32; 0: no cut, and one above the "
                       f"vocabulary cuts nothing), got {self.top_k!r}")
    if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real)
                                   or not 0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

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


def filtered_logits_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
                         ) -> jax.Array:
  """``filtered_logits`` with parameters per row: logits [B, V], temperature fp32 [B] (rows at 0 are left unscaled:
  greedy rows take the argmax), top_k int32 [B] (0 = no cut), top_p fp32 [B] (1 = no cut). The vocabulary sort
  that top-k / top-p need runs only when some sampled row asks for a cut."""
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  neg_inf = jnp.finfo(jnp.float32).min
  use_k, use_p = (top_k > 0)[:, None], (top_p < 1.0)[:, None]

  def cut(x: jax.Array) -> jax.Array:
    ordered = jnp.sort(x, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, x.shape[-1]) - 1)[:, None], axis=-1)
    x = jnp.where(use_k & (x < kth), neg_inf, x)
    ordered = jnp.where(use_k & (ordered < kth), neg_inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays), as filtered_logits does.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.take_along_axis(ordered, jnp.sum(mass_before < top_p[:, None], axis=-1, keepdims=True) - 1, axis=-1)
    return jnp.where(use_p & (x < cutoff), neg_inf, x)

  return jax.lax.cond(jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0))), cut, lambda x: x, scaled)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
                ) -> jax.Array:
  """``sample`` with parameters and a random key per row (``filtered_logits_rows``'s arguments; keys [B]) -> int32
  token ids [B]. Row b's token depends only on its own logits, parameters and key, not on the other rows."""
  drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits_rows(logits, temperature, top_k, top_p))
  return jnp.where(temperature <= 0.0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
