"""The M3 causal language model (text backbone): embed -> decoder layers -> final norm -> untied LM head."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax import logical_axes as ax
from m3jax import sharding
from m3jax.cache import LayerCache, PagedLayerCache
from m3jax.config import M3Config
from m3jax.layers.decoder import DecodeWeights, DecoderLayer
from m3jax.layers.mtp import MTPLayer
from m3jax.layers.norms import RMSNorm
from m3jax.layers.params import make_param, project
from m3jax.layers.quantized import ParamPath, QuantSpec, apply_quantized
from m3jax.layers.rope import rope_cos_sin
from m3jax.ops.dispatch import KernelChoice, resolve_kernels
from m3jax.research import Collect
from m3jax.token_ids import check_no_placeholders
from m3jax.vision import embed as vision_embed
from m3jax.vision.encoder import VisionModel


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
  """logits fp32 [B, S, V]; caches: one LayerCache per layer (or None); hidden: final-normed [B, S, H] at every
  token (also with ``logits_at``); intermediates: one dict per layer when ``forward(collect=...)`` asked for any (see m3jax.research)."""

  logits: jax.Array
  caches: tuple[LayerCache, ...] | None
  hidden: jax.Array
  intermediates: tuple[dict[str, jax.Array], ...] | None = None


SUPPORTED_DTYPES = ("bfloat16", "float32")


def model_dtype(dtype: Any) -> jnp.dtype:
  """The parameter / activation dtype a model can run in: bfloat16 (the default) or float32 (exact parity);
  anything else (float16, an integer type, an unknown name) raises ValueError naming the supported ones."""
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    raise ValueError(f"dtype {dtype!r} is not a dtype; expected one of {SUPPORTED_DTYPES}") from None
  if resolved.name not in SUPPORTED_DTYPES:
    raise ValueError(f"dtype {resolved.name} is not supported; expected one of {SUPPORTED_DTYPES}")
  return resolved


class M3ForCausalLM(nnx.Module):
  """MiniMax M3 text model. ``model(input_ids)`` returns fp32 logits [B, S, V].

  Args:
    config: the whole-model config (only ``config.text`` is used here).
    dtype: parameter and activation dtype (bf16 by default; fp32 for exact parity). Router weights and
      correction biases are always fp32.
    kernels: 'reference' | 'pallas' | 'auto' (default: $M3JAX_KERNELS or 'auto').
    rngs: initialiser RNGs (None: zero-initialised parameters, e.g. before loading a checkpoint).
    with_vision: also build the vision tower + projector (``self.vision``; needs ``config.vision``), enabling
      ``model(input_ids, pixel_values=..., image_grid_thw=..., ...)``. Off by default (text-only model).
    with_mtp: also build the config's ``num_mtp_modules`` multi-token-prediction modules (``self.mtp``;
      ``mtp_forward``), the draft heads of speculative decoding (m3jax.speculative). Off by default.
    quantized: {parameter path: QuantSpec} of linear weights kept in fp8 (``m3jax.layers.quantized``: each
      becomes a QuantizedLinear with ``values`` / ``scales``; with ``rngs`` they quantize the random weights).
      ``m3jax.load(path, keep_quantized=True)`` builds it from the checkpoint.
  """

  def __init__(self, config: M3Config, *, dtype: jnp.dtype = jnp.bfloat16, kernels: str | None = None,
               rngs: nnx.Rngs | None = None, with_vision: bool = False, with_mtp: bool = False,
               quantized: dict[ParamPath, QuantSpec] | None = None):
    cfg = config.text
    self.config = config
    self.dtype = dtype = model_dtype(dtype)
    self.kernels: KernelChoice = resolve_kernels(kernels)
    self.embed = make_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (ax.VOCAB, ax.EMBED), std=1.0)
    self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, kernels=self.kernels, rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.lm_head = (None if cfg.tie_word_embeddings else
                    make_param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (ax.EMBED, ax.VOCAB)))
    if with_vision and config.vision is None:
      raise ValueError("with_vision=True needs a config with a vision_config")
    self.vision = VisionModel(config, dtype=dtype, rngs=rngs) if with_vision else None
    if with_mtp and cfg.num_mtp_modules < 1:
      raise ValueError("with_mtp=True needs a config with num_mtp_modules >= 1 (config.json has "
                       f"num_mtp_modules={cfg.num_mtp_modules})")
    self.mtp = (nnx.List([MTPLayer(cfg, dtype=dtype, kernels=self.kernels, rngs=rngs)
                          for _ in range(cfg.num_mtp_modules)]) if with_mtp else None)
    if quantized:
      apply_quantized(self, quantized)
    # Mesh + logical-axis rules (m3jax.sharding.ShardingPlan), set by m3jax.load(mesh=...) / shard_model.
    self.sharding_plan: sharding.ShardingPlan | None = None

  @property
  def placeholder_ids(self) -> tuple[int, ...]:
    """The image and video placeholder token ids when the vision tower is built (each stands for a vision feature,
    so a text-only call holding one is refused), else () (a text-only model embeds every id as text)."""
    return (self.config.image_token_id, self.config.video_token_id) if self.vision is not None else ()

  @sharding.uses_model_plan
  def init_caches(self, batch: int, max_length: int, dtype: jnp.dtype | None = None) -> tuple[LayerCache, ...]:
    """Zeroed per-layer caches for ``batch`` sequences of up to ``max_length`` tokens (laid out by the
    sharding plan, with KV heads repeated when the tensor axis has more ranks than KV heads).

    Prefer a multiple of 128 (the key block): the attention kernels pad other lengths, a copy per call.
    """
    if batch < 1 or max_length < 1:
      raise ValueError(f"init_caches needs batch >= 1 and max_length >= 1, got batch={batch}, max_length={max_length}")
    return tuple(self._layer_cache(batch, max_length, kind == "sparse", dtype)
                 for kind in self.config.text.attention_types)

  def _layer_cache(self, batch: int, max_length: int, sparse: bool, dtype: jnp.dtype | None) -> LayerCache:
    """One layer's zeroed cache (KV heads repeated when the tensor axis has more ranks than KV heads)."""
    cfg = self.config.text
    kv_heads = cfg.num_kv_heads * sharding.head_replication(cfg.num_kv_heads)
    return LayerCache.zeros(batch, max_length, kv_heads, cfg.head_dim, cfg.index_head_dim if sparse else None,
                            dtype or self.dtype)

  @sharding.uses_model_plan
  def init_paged_caches(self, num_pages: int, page_size: int, dtype: jnp.dtype | None = None
                        ) -> tuple[PagedLayerCache, ...]:
    """Zeroed per-layer pools of ``num_pages`` pages of ``page_size`` tokens (m3jax.cache.PagedLayerCache; set
    each call's page tables with ``with_table``). A page holds a whole number of the indexer's key blocks."""
    cfg = self.config.text
    if num_pages < 1 or page_size < 1 or page_size % cfg.index_block_size:
      raise ValueError(f"init_paged_caches needs num_pages >= 1 and page_size a multiple of the index block "
                       f"({cfg.index_block_size}), got num_pages={num_pages}, page_size={page_size}")
    kv_heads = cfg.num_kv_heads * sharding.head_replication(cfg.num_kv_heads)
    return tuple(PagedLayerCache.zeros(num_pages, page_size, kv_heads, cfg.head_dim,
                                       cfg.index_head_dim if kind == "sparse" else None, dtype or self.dtype)
                 for kind in cfg.attention_types)

  @sharding.uses_model_plan
  def init_mtp_caches(self, batch: int, max_length: int, dtype: jnp.dtype | None = None) -> tuple[LayerCache, ...]:
    """Zeroed caches of the MTP modules (one sparse-layer cache each), laid out like ``init_caches``'."""
    return tuple(self._layer_cache(batch, max_length, True, dtype) for _ in self._mtp_modules())

  @sharding.uses_model_plan
  def mtp_decode_weights(self) -> tuple[DecodeWeights, ...]:
    """``decode_weights`` of the MTP modules' layers, for ``mtp_forward(decode_weights=...)`` in a loop."""
    return tuple(m.layer.decode_weights() for m in self._mtp_modules())

  @sharding.uses_model_plan
  def mtp_forward(self, next_ids: jax.Array, prev_hidden: jax.Array, *, positions: jax.Array,
                  caches: tuple[LayerCache, ...] | None = None, step: int = 0, logits_at: jax.Array | None = None,
                  decode_weights: Sequence[DecodeWeights] | None = None,
                  next_embeds: jax.Array | None = None, collect: Collect | None = None,
                  dense_attention: bool = False) -> ForwardOutput:
    """One draft step of MTP module ``step % num_mtp_modules`` (M3_SPEC §8).

    Args:
      next_ids: int32 [B, S], the token x_{t+1} that follows each position t.
      prev_hidden: [B, S, H], at the first draft step the target's final-normed hidden state h_t
        (``forward(...).hidden``); at later steps the previous step's ``hidden``.
      positions: int32 [B, S], the target positions t.
      caches: the MTP modules' caches (``init_mtp_caches``); only module ``step % n`` is read and written.
      step: the draft step (selects the module when there are several).
      logits_at: optional int32 [B]: logits (and ``hidden``) at this index of each row only ([B, 1, ...]).
      decode_weights: ``mtp_decode_weights()`` built once outside a loop.
      next_embeds: optional [B, S, H] embeddings of x_{t+1} replacing the token embeddings of next_ids (a
        multimodal prompt's ``embed_multimodal`` output shifted left by one: image / video features, as the
        target read them one position later); next_ids is still checked.
      collect: research intermediates of the module's layer (m3jax.research.Collect), as ``forward``'s.
      dense_attention: the module's sparse layer attends densely (``forward``'s; indexer warm-up training).

    Returns:
      ForwardOutput: logits fp32 [B, S, V] (distribution of x_{t+2}); hidden [B, S, H] (the module's output
      before its final norm, what a next draft step reads); caches with module ``step % n``'s updated;
      intermediates: (the layer's record,) when ``collect`` is given.
    """
    modules = self._mtp_modules()
    _check_ids(next_ids, self.config.text.vocab_size)
    b, s = next_ids.shape
    if positions.shape != (b, s) or prev_hidden.shape[:2] != (b, s):
      raise ValueError(f"next_ids {next_ids.shape}, positions {positions.shape} and prev_hidden "
                       f"{prev_hidden.shape} must agree on [batch, seq]")
    if next_embeds is not None and next_embeds.shape != prev_hidden.shape:
      raise ValueError(f"next_embeds has shape {next_embeds.shape}; expected {prev_hidden.shape} like prev_hidden")
    i = step % len(modules)
    module = modules[i]
    embeds = self.embed_tokens(next_ids) if next_embeds is None else next_embeds.astype(self.dtype)
    out, cache, record = module(embeds, prev_hidden, positions=positions,
                                cache=None if caches is None else caches[i],
                                prepared=None if decode_weights is None else decode_weights[i], collect=collect,
                                dense_attention=dense_attention)
    if logits_at is not None:
      out = _at_index(out, logits_at)
    logits = self._lm_logits(module.final_norm(out))
    new_caches = None if caches is None else tuple(cache if j == i else c for j, c in enumerate(caches))
    return ForwardOutput(logits=logits, caches=new_caches, hidden=out,
                         intermediates=None if collect is None else (record,))

  def _mtp_modules(self) -> nnx.List:
    if self.mtp is None:
      raise ValueError("this model has no MTP modules (build or load it with with_mtp=True)")
    return self.mtp

  def _lm_logits(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [B, S, H] -> fp32 logits [B, S, V] through the (possibly tied) LM head."""
    head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return sharding.constrain(project("bsh,hv->bsv", hidden, head, out_dtype=jnp.float32),
                              (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB))

  def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
    """input_ids int [B, S] -> embeddings [B, S, H] (plain lookup, no scaling)."""
    return jnp.take(self.embed[...], input_ids, axis=0)

  @sharding.uses_model_plan
  def decode_weights(self) -> tuple[DecodeWeights, ...]:
    """Every layer's weights prepared for a loop of decode steps (``DecoderLayer.decode_weights``), for
    ``forward``'s ``decode_weights``: build them once before a decode loop (inside the same jit) so that the
    loop's steps do not rebuild them. They hold one more copy of the q / k / v / index weights, fused (the
    plan's "decode-loop workspace"), and for fp32 weights on the MoE kernels the experts' bf16 split (1.5x the
    expert weights)."""
    return tuple(layer.decode_weights() for layer in self.layers)

  @sharding.uses_model_plan
  def forward(
      self,
      input_ids: jax.Array,
      *,
      positions: jax.Array | None = None,
      caches: tuple[LayerCache, ...] | None = None,
      inputs_embeds: jax.Array | None = None,
      logits_at: jax.Array | None = None,
      collect: Collect | None = None,
      decode_weights: Sequence[DecodeWeights] | None = None,
      dense_attention: bool = False,
  ) -> ForwardOutput:
    """Runs the backbone.

    Args:
      input_ids: int32 [B, S].
      positions: int32 [B, S] position of each token in its own sequence; required with caches, and
        must be 0..S-1 (the default) without them.
      caches: per-layer caches to write into and attend over (from ``init_caches``).
      inputs_embeds: optional [B, S, H] replacing the token embeddings (multimodal inputs).
      logits_at: optional int32 [B]: compute logits only at this index of each row (prefill), giving
        logits [B, 1, V] instead of [B, S, V].
      collect: research intermediates to record (m3jax.research.Collect); off by default.
      decode_weights: ``decode_weights()`` built once outside a decode loop; by default each layer prepares
        its weights itself (fuses its projection weights, splits fp32 expert weights for the kernels).
      dense_attention: sparse layers attend densely (causal, no block selection): the dense warm-up phase of
        indexer training (m3jax.training). Off by default (M3's own sparse attention).

    Returns:
      ForwardOutput with fp32 logits [B, S, V] (or [B, 1, V] with logits_at).
    """
    cfg = self.config.text
    _check_ids(input_ids, cfg.vocab_size)
    b, s = input_ids.shape
    if positions is None:
      if caches is not None:
        raise ValueError("forward with caches needs explicit positions [B, S]")
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if positions.shape != (b, s):
      raise ValueError(f"positions has shape {positions.shape}, expected {(b, s)} like input_ids")
    if caches is not None:
      _check_caches(caches, cfg.num_layers, positions)
    if decode_weights is not None and len(decode_weights) != cfg.num_layers:
      raise ValueError(f"got decode_weights for {len(decode_weights)} layers, the model has {cfg.num_layers}")
    h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.astype(self.dtype)
    h = sharding.constrain(h, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    new_caches, records = [], []
    for i, layer in enumerate(self.layers):
      h, c, record = layer(h, positions=positions, cos=cos, sin=sin, cache=None if caches is None else caches[i],
                           collect=collect, prepared=None if decode_weights is None else decode_weights[i],
                           dense_attention=dense_attention)
      new_caches.append(c)
      records.append(record)
    hidden = self.final_norm(h)
    logits = self._lm_logits(hidden if logits_at is None else _at_index(hidden, logits_at))
    return ForwardOutput(logits=logits, caches=None if caches is None else tuple(new_caches), hidden=hidden,
                         intermediates=None if collect is None else tuple(records))

  def embed_multimodal(self, input_ids: jax.Array, **pixel_inputs) -> jax.Array:
    """input_ids int [B, S] + pixel inputs (as in ``__call__``) -> inputs_embeds [B, S, H] with the vision
    features scattered into the image / video placeholder tokens (for ``forward(inputs_embeds=...)``)."""
    input_ids = jnp.asarray(input_ids)
    _check_ids(input_ids, self.config.text.vocab_size)
    return vision_embed.multimodal_embeddings(self, input_ids, **pixel_inputs)

  def __call__(self, input_ids: jax.Array, *, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
               video_grid_thw=None) -> jax.Array:
    """input_ids int32 [B, S] -> fp32 logits [B, S, V] (one jit-compiled full forward).

    Multimodal inputs use HF's flattened patch format (``m3jax.vision`` builds them): pixel_values
    [N, C*T*P*P] with image_grid_thw int [num_images, 3], pixel_values_videos / video_grid_thw likewise;
    input_ids must hold one placeholder token per merged patch (checked).
    """
    input_ids = jnp.asarray(input_ids)
    _check_ids(input_ids, self.config.text.vocab_size)
    pixel_inputs = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                        pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)
    if any(v is not None for v in pixel_inputs.values()):
      return vision_embed.multimodal_logits(self, input_ids, **pixel_inputs)
    if not isinstance(input_ids, jax.core.Tracer):
      check_no_placeholders(input_ids, self.placeholder_ids, "input_ids")
    return _jit_logits(self, input_ids.astype(jnp.int32))


@nnx.jit
def _jit_logits(model: M3ForCausalLM, input_ids: jax.Array) -> jax.Array:
  return model.forward(input_ids).logits


def _at_index(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, S, ...], index int [B] -> [B, 1, ...]: each row's entry at its own index (``logits_at``)."""
  return jnp.take_along_axis(x, index.astype(jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


def _check_caches(caches: Sequence[LayerCache], num_layers: int, positions: jax.Array) -> None:
  """One cache per layer, each with the batch of ``positions`` [B, S]; concrete positions (outside a trace) must
  lie in [0, cache length): the cache write would drop a token past the end without a word."""
  if len(caches) != num_layers:
    raise ValueError(f"got {len(caches)} layer caches for {num_layers} layers")
  b = positions.shape[0]
  for i, c in enumerate(caches):
    if c.batch != b:
      raise ValueError(f"layer {i}'s cache holds {c.batch} sequences but the input has {b} "
                       f"(init_caches(batch={b}, ...))")
  if not isinstance(positions, jax.core.Tracer) and positions.size:
    lo, hi, length = int(jnp.min(positions)), int(jnp.max(positions)), caches[0].max_length
    if lo < 0 or hi >= length:
      raise ValueError(f"positions span [{lo}, {hi}] but the caches hold positions [0, {length}); "
                       f"make them with init_caches(batch, max_length > {hi})")


def _check_ids(input_ids: jax.Array, vocab_size: int) -> None:
  if input_ids.ndim != 2:
    raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
  if 0 in input_ids.shape:
    raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; it needs at least one sequence of at least "
                     "one token")
  if not jnp.issubdtype(input_ids.dtype, jnp.integer):
    raise ValueError(f"input_ids must be integers, got {input_ids.dtype}")
  if not isinstance(input_ids, jax.core.Tracer):
    lo, hi = int(jnp.min(input_ids)), int(jnp.max(input_ids))
    if lo < 0 or hi >= vocab_size:
      raise ValueError(f"input_ids outside [0, {vocab_size}): min {lo}, max {hi}")
