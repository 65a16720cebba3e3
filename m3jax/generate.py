"""Generation: jit-compiled prefill and decode over per-layer caches, one-jit generate, streaming.

Prompts of different lengths are right-padded to a power-of-two bucket; every cache is anchored to its
sequence's own positions, so each sequence gets exactly the tokens it would get alone (pad slots are
overwritten by real tokens before any query can see them). Prompts in the same bucket share one compile.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import sharding
from m3jax.model import M3ForCausalLM
from m3jax.sampling import SamplingParams, sample
from m3jax.token_ids import check_count, check_no_placeholders, is_token_id, resolve_stop_ids, token_list

_MIN_BUCKET = 16
_CACHE_ALIGN = 128
_MIN_TOKEN_BUFFER = 32


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """tokens int32 [B, max_new_tokens] (``pad_token_id`` after a stop); lengths int32 [B] (new tokens per
  sequence, a stop token included)."""

  tokens: np.ndarray
  lengths: np.ndarray


def bucket_length(n: int) -> int:
  """The padded prompt length: the next power of two >= n (at least 16)."""
  return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]] | np.ndarray, pad_token_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
  """A ragged list of prompts (or an int array [B, S]) -> (right-padded int32 [B, bucket], lengths [B])."""
  if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompt_ids must be [batch, seq] or a list of lists, got shape {arr.shape}")
    prompts = list(arr)
  if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
    raise ValueError(f"expected a non-empty batch of token-id lists, got {prompts!r:.60}")
  if any(is_token_id(p) for p in prompts):
    raise ValueError(f"prompt_ids is a batch of prompts (a list of token-id lists, or an array [batch, seq]), but "
                     f"got a flat list of ids {prompts!r:.40}; for one prompt write [[...]]")
  prompts = [token_list(p, f"prompt {i}") for i, p in enumerate(prompts)]
  empty = [i for i, p in enumerate(prompts) if not p]
  if empty:
    raise ValueError(f"every prompt needs at least one token; prompts {empty[:8]} are empty")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  padded = np.full((len(prompts), bucket_length(int(lengths.max()))), pad_token_id, np.int32)
  for i, p in enumerate(prompts):
    padded[i, : len(p)] = p
  return padded, lengths


def token_buffer_width(max_new_tokens: int) -> int:
  """Width of generate's on-device token buffer: the next power of two >= max_new_tokens (at least 32). The
  decode loop stops at max_new_tokens (a traced value), so calls whose max_new_tokens share a width (and whose
  prompts share a bucket and a cache length) share one compiled program."""
  return max(_MIN_TOKEN_BUFFER, 1 << (max(max_new_tokens, 1) - 1).bit_length())


def cache_length_for(prompt_bucket: int, max_new_tokens: int) -> int:
  """Cache slots needed for a bucket plus max_new_tokens, rounded up to a multiple of 128."""
  need = prompt_bucket + max_new_tokens
  return -(-need // _CACHE_ALIGN) * _CACHE_ALIGN


def pad_embeds(prompt_embeds: jax.Array | np.ndarray | None, padded: np.ndarray) -> jax.Array | None:
  """Right-pads multimodal prompt embeddings [B, S, H] to the prompt bucket [B, bucket, H]."""
  if prompt_embeds is None:
    return None
  b, bucket = padded.shape
  if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != b or prompt_embeds.shape[1] > bucket:
    raise ValueError(f"prompt_embeds has shape {tuple(prompt_embeds.shape)}; expected [batch={b}, <= {bucket}, hidden]")
  return jnp.pad(jnp.asarray(prompt_embeds), ((0, 0), (0, bucket - prompt_embeds.shape[1]), (0, 0)))


def check_padded_ids(padded: np.ndarray, lengths: np.ndarray, vocab_size: int, what: str) -> None:
  """Raises ValueError naming ``what`` when an id of the right-padded rows [B, S] (their first ``lengths`` [B]
  entries; the padding is not looked at) lies outside [0, vocab_size)."""
  real = padded[np.arange(padded.shape[1])[None] < lengths[:, None]]
  if real.min() < 0 or real.max() >= vocab_size:
    raise ValueError(f"{what} outside [0, {vocab_size}): min {real.min()}, max {real.max()}")


def stop_ids(model: M3ForCausalLM, eos_token_ids: Sequence[int] | None) -> jax.Array:
  """int32 [n] stop tokens for a generation loop: the config's eos ids when None; () gives [-1] (never stops)."""
  eos = resolve_stop_ids(eos_token_ids, model.config.text.eos_token_ids, model.config.text.vocab_size)
  return jnp.asarray(list(eos) or [-1], jnp.int32)


def _put_fn(model: M3ForCausalLM):
  """Host value -> jax.Array replicated over the model's mesh (global inputs under jax.distributed)."""
  return functools.partial(sharding.put_replicated, plan=model.sharding_plan)


def _put_embeds(put, prompt_embeds, padded: np.ndarray) -> jax.Array | None:
  embeds = pad_embeds(prompt_embeds, padded)
  return None if embeds is None else put(embeds)


def _validate(model: M3ForCausalLM, lengths: np.ndarray, padded: np.ndarray, max_new_tokens: int,
              max_length: int | None, prompt_embeds: jax.Array | np.ndarray | None = None) -> int:
  """Checks sizes before any compute; returns the cache length. Without ``prompt_embeds``, image / video
  placeholder ids of a model with a vision tower are refused (they would be embedded as text)."""
  check_count(max_new_tokens, "max_new_tokens")
  if max_length is not None:
    check_count(max_length, "max_length")
  check_padded_ids(padded, lengths, model.config.text.vocab_size, "prompt ids")
  if prompt_embeds is None:
    check_no_placeholders(padded[np.arange(padded.shape[1])[None] < lengths[:, None]], model.placeholder_ids,
                          "the prompt ids")
  longest = int(lengths.max())
  limit = model.config.text.max_position_embeddings if max_length is None else max_length
  if longest > limit:
    raise ValueError(f"prompt of {longest} tokens is longer than the cache ({limit} tokens)")
  if longest + max_new_tokens > limit:
    raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the cache "
                     f"({limit} tokens)")
  cache_len = cache_length_for(padded.shape[1], max_new_tokens)
  if max_length is None:
    return cache_len
  # Capped by max_length, then aligned: key blocks of 128 (an unaligned cache would be padded, i.e. copied,
  # by the attention kernels at every step).
  need = max(min(cache_len, max_length), longest + max_new_tokens)
  return -(-need // _CACHE_ALIGN) * _CACHE_ALIGN


def check_prefill_chunk(prefill_chunk: int | None) -> None:
  """A prefill chunk must be a power of two >= 16, so that it divides every prompt bucket it is shorter than."""
  if prefill_chunk is not None and (prefill_chunk < _MIN_BUCKET or prefill_chunk & (prefill_chunk - 1)):
    raise ValueError(f"prefill_chunk must be a power of two >= {_MIN_BUCKET}, got {prefill_chunk}")


def prefill_in_chunks(run, inputs: tuple[jax.Array | None, ...], lengths: jax.Array, caches: tuple,
                      chunk: int | None, start: jax.Array | None = None, max_position: int | None = None):
  """Runs a prefill over right-padded prompts in chunks of ``chunk`` tokens (all at once when chunk is None or
  >= the prompt length S), each chunk at its own positions, writing the caches and attending over them: chunk c
  reads the keys of chunks 0 .. c. The chunks run in a ``lax.scan`` (one compiled forward), so peak activation
  memory is a chunk's.

  Args:
    run: (inputs_c, positions int32 [B, N], caches, at int32 [B]) -> (rows, tokens, caches), where inputs_c are
      ``inputs`` cut to the chunk ([B, N, ...]; None stays None), ``rows`` a pytree of [B, ...] values taken at
      index ``at`` of each row, ``tokens`` a pytree of [B, N, ...] values per token.
    inputs: [B, S, ...] arrays (or None).
    lengths: int32 [B] prompt lengths; ``rows`` are kept from the chunk that holds each row's last token.
    start: int32 [B] position of each row's first token (default 0): the tokens continue sequences whose caches
      already hold positions 0 .. start - 1, and attend to them.
    max_position: positions are clipped to this (the caches' last slot), so that padding past the end of the
      caches neither writes outside them nor queries past them; real tokens must lie below it (callers check).

  Returns:
    (rows at each row's position lengths - 1, tokens over all S positions [B, S, ...], caches).
  """
  b, s = next(x for x in inputs if x is not None).shape[:2]
  last = lengths - 1
  first = jnp.zeros((b, 1), jnp.int32) if start is None else start.astype(jnp.int32)[:, None]

  def place(offsets: jax.Array) -> jax.Array:
    positions = first + offsets[None]
    return positions if max_position is None else jnp.minimum(positions, max_position)

  if chunk is None or chunk >= s:
    return run(inputs, place(jnp.arange(s, dtype=jnp.int32)), caches, last)
  n = s // chunk
  xs = tuple(None if x is None else jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0) for x in inputs)
  offsets = jnp.arange(chunk, dtype=jnp.int32)

  def body(caches, c_x):
    c, x_c = c_x
    positions = place(c * chunk + offsets)
    rows, tokens, caches = run(x_c, positions, caches, jnp.clip(last - c * chunk, 0, chunk - 1))
    return caches, (rows, tokens)

  caches, (rows, tokens) = jax.lax.scan(body, caches, (jnp.arange(n, dtype=jnp.int32), xs))
  # rows: [n, B, ...] per chunk -> each row's entry from the chunk holding its last token.
  mine = last // chunk
  rows = jax.tree.map(lambda r: jnp.moveaxis(r, 0, 1)[jnp.arange(b), mine], rows)
  tokens = jax.tree.map(lambda t: jnp.moveaxis(t, 0, 1).reshape(b, s, *t.shape[3:]), tokens)
  return rows, tokens, caches


def _prefill(model: M3ForCausalLM, prompt: jax.Array, lengths: jax.Array, cache_len: int,
             embeds: jax.Array | None = None, chunk: int | None = None) -> tuple[jax.Array, tuple]:
  """prompt int32 [B, S], lengths [B] (embeds [B, S, H] for multimodal prompts) -> (logits fp32 [B, V] at each
  last prompt token, caches); ``chunk``: prefill in chunks of this many tokens (``prefill_in_chunks``)."""

  def run(x, positions, caches, at):
    ids, emb = x
    out = model.forward(ids, positions=positions, caches=caches, logits_at=at, inputs_embeds=emb)
    return out.logits[:, 0], (), out.caches

  logits, _, caches = prefill_in_chunks(run, (prompt, embeds), lengths, model.init_caches(prompt.shape[0], cache_len),
                                        chunk)
  return logits, caches


def _decode(model: M3ForCausalLM, tokens: jax.Array, positions: jax.Array, caches: tuple,
            decode_weights: tuple | None = None) -> tuple[jax.Array, tuple]:
  """tokens int32 [B] at positions [B] -> (next-token logits fp32 [B, V], caches). ``decode_weights``: the
  model's ``decode_weights()``, built once before a loop of decode steps."""
  out = model.forward(tokens[:, None], positions=positions[:, None], caches=caches, decode_weights=decode_weights)
  return out.logits[:, 0], out.caches


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "sampling", "cache_len", "chunk"))
def _generate_jit(graphdef, state, prompt, lengths, key, eos_ids, pad_id, embeds, max_new_tokens, *, width: int,
                  sampling: SamplingParams, cache_len: int, chunk: int | None = None):
  """The whole generation loop (prefill + lax.while_loop of decode steps) as one XLA program: tokens int32
  [B, width] (pad_id past ``max_new_tokens``, an int32 scalar <= width), lengths int32 [B]."""
  model = nnx.merge(graphdef, state)
  b = prompt.shape[0]
  logits, caches = _prefill(model, prompt, lengths, cache_len, embeds, chunk)
  prepared = model.decode_weights()  # once, not per step (XLA:GPU does not hoist them out of the loop)

  def cond(carry):
    step, _, _, _, _, done, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, logits, caches, tokens, new_lengths, done, key = carry
    key, sub = jax.random.split(key)
    tok = jnp.where(done, pad_id, sample(logits, sub, sampling))
    tokens = tokens.at[:, step].set(tok)
    new_lengths = new_lengths + (~done).astype(jnp.int32)
    done = done | jnp.isin(tok, eos_ids)
    logits, caches = _decode(model, tok, lengths + step, caches, prepared)
    return step + 1, logits, caches, tokens, new_lengths, done, key

  init = (jnp.int32(0), logits, caches, jnp.full((b, width), pad_id, jnp.int32),
          jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), key)
  _, _, _, tokens, new_lengths, _, _ = jax.lax.while_loop(cond, body, init)
  return sharding.replicated(tokens, model.sharding_plan), sharding.replicated(new_lengths, model.sharding_plan)


def generate(
    model: M3ForCausalLM,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    pad_token_id: int = 0,
    max_length: int | None = None,
    prompt_embeds: jax.Array | None = None,
    prefill_chunk: int | None = None,
) -> GenerateOutput:
  """Generates up to ``max_new_tokens`` for each prompt in one jit-compiled program.

  Args:
    model: a loaded M3ForCausalLM.
    prompt_ids: a list of token-id lists (lengths may differ) or an int array [B, S].
    max_new_tokens: new tokens per sequence (the output width).
    temperature, top_k, top_p, seed: sampling (temperature 0 = greedy); reproducible for a given seed.
    eos_token_ids: stop tokens; None = the config's eos ids; () = never stop early.
    pad_token_id: written after a sequence stops.
    max_length: cache size in tokens (default: enough for the prompt bucket + max_new_tokens, capped by
      max_position_embeddings); the cache gets it rounded up to a multiple of 128 slots (the key block). A
      prompt (+ max_new_tokens) that does not fit is an error before compute.
    prompt_embeds: optional [B, S, H] prompt embeddings replacing the token embeddings (images / videos:
      ``model.embed_multimodal``); prompt_ids still give the lengths and are checked.
    prefill_chunk: prefill the prompts in chunks of this many tokens (a power of two >= 16), each attending to
      the cache of the ones before, which bounds the prefill's activation memory by a chunk's; None (default):
      the whole prompt bucket in one forward. The tokens are the same up to floating-point reassociation.

  Returns:
    GenerateOutput(tokens [B, max_new_tokens], lengths [B]).
  """
  check_prefill_chunk(prefill_chunk)
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  padded, lengths = pad_prompts(prompt_ids, pad_token_id)
  cache_len = _validate(model, lengths, padded, max_new_tokens, max_length, prompt_embeds)
  eos_arr = stop_ids(model, eos_token_ids)
  graphdef, state = nnx.split(model)
  put = _put_fn(model)
  tokens, new_lengths = _generate_jit(
      graphdef, state, put(padded), put(lengths), put(jax.random.key(seed)), put(eos_arr),
      put(np.int32(pad_token_id)), _put_embeds(put, prompt_embeds, padded), put(np.int32(max_new_tokens)),
      width=token_buffer_width(max_new_tokens), sampling=sampling, cache_len=cache_len, chunk=prefill_chunk)
  return GenerateOutput(tokens=np.asarray(tokens)[:, :max_new_tokens], lengths=np.asarray(new_lengths))


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "chunk"))
def _prefill_jit(graphdef, state, prompt, lengths, embeds, *, cache_len: int, chunk: int | None = None):
  return _prefill(nnx.merge(graphdef, state), prompt, lengths, cache_len, embeds, chunk)


class _GraphKey:
  """A model's nnx graph and the tree structure of its parameters, as one jit static argument whose hash is
  computed once: hashing the GraphDef of full M3 takes milliseconds, which jit would pay on every call."""

  __slots__ = ("graphdef", "treedef", "_hash")

  def __init__(self, graphdef, treedef):
    self.graphdef, self.treedef = graphdef, treedef
    self._hash = hash((graphdef, treedef))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return (isinstance(other, _GraphKey) and self._hash == other._hash and self.treedef == other.treedef
            and self.graphdef == other.graphdef)

  def merge(self, params: tuple[jax.Array, ...]) -> M3ForCausalLM:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))


@dataclasses.dataclass(frozen=True, eq=False)
class Decoder:
  """A model prepared once for a loop of decode steps (see ``decode_step`` for one step).

  Each jitted call hands over the parameters as a flat tuple of arrays with a pre-hashed graph, instead of
  splitting the module graph (``nnx.split`` of a 60-layer model takes tens of ms) and flattening an nnx.State
  on every step, and prepares each layer's decode weights once (``decode_weights``) for all its steps.
  ``generate_stream`` runs its steps through ``Decoder.sample_steps``; ``generate`` runs its whole loop on the
  device and pays no per-step host cost at all.
  """

  graph: _GraphKey
  params: tuple[jax.Array, ...]
  plan: sharding.ShardingPlan | None

  @functools.cached_property
  def decode_weights(self) -> tuple:
    """Every layer's weights prepared for decode steps (``M3ForCausalLM.decode_weights``), built on the first
    step and reused by every later one, so steps do not rebuild them: the projection weights fused (6.5 % of a
    full-depth step at batch 4 on the H200, BENCHMARKS.md) and, for fp32 weights on the MoE kernels, the
    experts' bf16 split. Held while the Decoder lives (the memory plan's "decode-loop workspace")."""
    return _decode_weights_jit(self.graph, self.params)

  @classmethod
  def of(cls, model: M3ForCausalLM) -> Decoder:
    graphdef, state = nnx.split(model)
    params, treedef = jax.tree.flatten(state)
    return cls(_GraphKey(graphdef, treedef), tuple(params), model.sharding_plan)

  def init_caches(self, batch: int, length: int) -> tuple:
    """Zeroed caches for ``batch`` sequences of ``length`` slots (``M3ForCausalLM.init_caches``, laid out by the
    model's sharding plan), in one jitted call."""
    return _init_caches_jit(self.graph, self.params, batch=batch, length=length)

  def init_paged_caches(self, num_pages: int, page_size: int) -> tuple:
    """Zeroed per-layer page pools (``M3ForCausalLM.init_paged_caches``), in one jitted call."""
    return _init_paged_caches_jit(self.graph, self.params, num_pages=num_pages, page_size=page_size)

  def put(self, x) -> jax.Array:
    """Host value -> jax.Array replicated over the model's mesh."""
    return sharding.put_replicated(x, plan=self.plan)

  def step(self, tokens: jax.Array | np.ndarray, positions: jax.Array | np.ndarray, caches: tuple
           ) -> tuple[jax.Array, tuple]:
    """tokens int32 [B] written at positions int32 [B] (each sequence's own) -> (next-token logits fp32
    [B, V], updated caches). The input caches are donated (do not reuse them)."""
    tokens, positions = np.asarray(tokens, np.int32), np.asarray(positions, np.int32)
    if tokens.shape != positions.shape or tokens.ndim != 1:
      raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must both be [batch]")
    max_len, batch = caches[0].max_length, caches[0].k.shape[0]
    if tokens.shape[0] != batch:
      raise ValueError(f"{tokens.shape[0]} tokens for caches of {batch} sequences")
    if positions.min() < 0 or positions.max() >= max_len:
      raise ValueError(f"positions span [{int(positions.min())}, {int(positions.max())}]: outside the cache "
                       f"([0, {max_len}) tokens)")
    return _decode_step_jit(self.graph, self.params, self.decode_weights, self.put(tokens), self.put(positions),
                            caches)

  def sample_steps(self, logits: jax.Array, caches: tuple, positions: np.ndarray, key: jax.Array,
                   sampling: SamplingParams, num_steps: int = 1) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
    """``num_steps`` decode steps in one call, each sampling its tokens from the previous logits (the first from
    ``logits``) and writing them at ``positions`` [B] + step. Each step splits ``key`` as ``generate`` does, so the
    tokens equal ``generate``'s. -> (tokens int32 [num_steps, B], next logits [B, V], caches, advanced key). The
    input caches are donated."""
    if num_steps < 1:
      raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return _sample_decode_jit(self.graph, self.params, self.decode_weights, logits, caches, self.put(positions), key,
                              sampling=sampling, num_steps=num_steps)


@functools.partial(jax.jit, static_argnames=("graph", "batch", "length"))
def _init_caches_jit(graph: _GraphKey, params, *, batch: int, length: int) -> tuple:
  return graph.merge(params).init_caches(batch, length)


@functools.partial(jax.jit, static_argnames=("graph", "num_pages", "page_size"))
def _init_paged_caches_jit(graph: _GraphKey, params, *, num_pages: int, page_size: int) -> tuple:
  return graph.merge(params).init_paged_caches(num_pages, page_size)


@functools.partial(jax.jit, static_argnames=("graph",))
def _decode_weights_jit(graph: _GraphKey, params) -> tuple:
  return graph.merge(params).decode_weights()


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("caches",))
def _decode_step_jit(graph: _GraphKey, params, decode_weights, tokens, positions, caches):
  return _decode(graph.merge(params), tokens, positions, caches, decode_weights)


@functools.partial(jax.jit, static_argnames=("graph", "sampling", "num_steps"), donate_argnames=("caches",))
def _sample_decode_jit(graph: _GraphKey, params, decode_weights, logits, caches, positions, key, *,
                       sampling: SamplingParams, num_steps: int):
  model = graph.merge(params)

  def step(i, carry):
    tokens, logits, caches, key = carry
    key, sub = jax.random.split(key)
    tok = sample(logits, sub, sampling)
    logits, caches = _decode(model, tok, positions + i, caches, decode_weights)
    return tokens.at[i].set(tok), logits, caches, key

  tokens = jnp.zeros((num_steps, logits.shape[0]), jnp.int32)
  carry = (tokens, logits, caches, key)
  # One step needs no loop; more run on the device, so the host's per-call cost is paid once per num_steps.
  tokens, logits, caches, key = step(0, carry) if num_steps == 1 else jax.lax.fori_loop(0, num_steps, step, carry)
  plan = model.sharding_plan
  return sharding.replicated(tokens, plan), logits, caches, sharding.replicated(key, plan)


@dataclasses.dataclass(frozen=True)
class PrefillOutput:
  """logits fp32 [B, V] at each prompt's last token; caches (one LayerCache per layer); lengths int32 [B]
  (the next position to write for each sequence)."""

  logits: jax.Array
  caches: tuple
  lengths: np.ndarray


def prefill(model: M3ForCausalLM, prompt_ids: Sequence[Sequence[int]] | np.ndarray, *, max_new_tokens: int,
            max_length: int | None = None, prompt_embeds: jax.Array | None = None,
            prefill_chunk: int | None = None) -> PrefillOutput:
  """Jit-compiled prefill of (ragged) prompts into fresh caches sized for ``max_new_tokens`` more tokens
  (``prefill_chunk`` as in ``generate``).

  Use with ``decode_step`` to drive decoding yourself (``generate`` does both in one program).
  """
  check_prefill_chunk(prefill_chunk)
  padded, lengths = pad_prompts(prompt_ids)
  cache_len = _validate(model, lengths, padded, max_new_tokens, max_length, prompt_embeds)
  graphdef, state = nnx.split(model)
  put = _put_fn(model)
  logits, caches = _prefill_jit(graphdef, state, put(padded), put(lengths), _put_embeds(put, prompt_embeds, padded),
                                cache_len=cache_len, chunk=prefill_chunk)
  return PrefillOutput(logits=logits, caches=caches, lengths=lengths)


def generate_stream(
    model: M3ForCausalLM,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    max_length: int | None = None,
    timings: dict[str, float] | None = None,
    prompt_embeds: jax.Array | None = None,
    steps_per_call: int = 1,
    prefill_chunk: int | None = None,
) -> Iterator[np.ndarray]:
  """Like ``generate``, yielding int32 tokens [B] as they are produced (jitted prefill + decode steps).

  A sequence that has stopped yields -1. Same tokens as ``generate`` for the same arguments. If
  ``timings`` is given it receives 'prefill_s' (prefill wall time, compile included on a first call).
  ``steps_per_call`` decode steps run in each jitted call (an on-device loop) and their tokens arrive together:
  a call costs the host milliseconds at full depth, more than a step's device time at small batch, so > 1
  trades streaming granularity for throughput (BENCHMARKS.md, "Full-depth decode"). Every call runs the same
  number of steps (one compile) while the cache has room for them; the last call may run a few steps past
  max_new_tokens, or past the point where every sequence has stopped, whose tokens are not yielded.
  """
  if steps_per_call < 1:
    raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  eos = list(set(resolve_stop_ids(eos_token_ids, model.config.text.eos_token_ids, model.config.text.vocab_size)))
  start = time.perf_counter()
  prefilled = prefill(model, prompt_ids, max_new_tokens=max_new_tokens, max_length=max_length,
                      prompt_embeds=prompt_embeds, prefill_chunk=prefill_chunk)
  logits, caches, lengths = prefilled.logits, prefilled.caches, prefilled.lengths
  if timings is not None:
    logits.block_until_ready()
    timings["prefill_s"] = time.perf_counter() - start
  decoder = Decoder.of(model)
  key = decoder.put(jax.random.key(seed))
  room = caches[0].max_length - int(lengths.max())  # steps the cache holds (>= max_new_tokens, validated)
  done = np.zeros(len(lengths), bool)
  produced = yielded = 0  # steps dispatched, tokens yielded
  pending = None  # the previous call's tokens [n, B], still on the device
  # Call c + 1 is dispatched before call c's tokens are read back, so the host's work on a call (argument
  # handling, graph launch: milliseconds at full size) overlaps the device's work on the one before. After the
  # last sequence stops, one call has run that nobody reads; its cache slots are inside the cache.
  while pending is not None or produced < max_new_tokens:
    dispatched = None
    if produced < max_new_tokens:
      # A full call if the cache has room (no second compile for a shorter last call), else what is left.
      n = steps_per_call if produced + steps_per_call <= room else max_new_tokens - produced
      dispatched, logits, caches, key = decoder.sample_steps(logits, caches, lengths + produced, key, sampling, n)
      produced += n
    if pending is not None:
      for ready in np.asarray(pending):
        out = np.where(done, -1, ready).astype(np.int32)
        done |= np.isin(ready, eos)
        yield out
        yielded += 1
        if done.all() or yielded == max_new_tokens:
          return
    pending = dispatched


def decode_step(model: M3ForCausalLM, tokens: jax.Array | np.ndarray, positions: jax.Array | np.ndarray,
                caches: tuple) -> tuple[jax.Array, tuple]:
  """One jit-compiled decode step: tokens int32 [B] written at positions int32 [B] (each sequence's own) ->
  (next-token logits fp32 [B, V], updated caches). The input caches are donated (do not reuse them).

  This prepares the model on every call (``Decoder.of``: tens of ms of host time at full depth, and its fused
  projection weights); a loop should make one ``Decoder`` and call its ``step``.
  """
  return Decoder.of(model).step(tokens, positions, caches)
