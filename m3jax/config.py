"""MiniMax M3 configuration: one frozen config type for text + vision + top level, parsed from config.json.

`M3Config.from_dict` accepts both spellings found in the wild:
  * the released / legacy MiniMax keys (``sparse_attention_config{...}``, ``moe_layer_freq``, top-level
    ``rope_theta`` / ``partial_rotary_factor`` / ``rotary_dim``, ``hidden_act: swigluoai``,
    ``n_shared_experts``, ``scoring_func``, ``use_routing_bias``, ``sparse_init_block``, ...), and
  * HF transformers' flat keys (``layer_types``, ``mlp_layer_types``, ``index_*``, ``rope_parameters``).
Unknown extra keys are tolerated; unsupported or inconsistent values raise `ConfigError` naming the key, and so do
missing dimensions (``REQUIRED_TEXT_KEYS``, ...): ``{}`` is not read as the full model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

AttentionType = Literal["full", "sparse"]
MlpType = Literal["dense", "moe"]


class ConfigError(ValueError):
  """A config.json value that m3jax cannot run faithfully."""


# Fields that must be > 0, with the config.json key that sets each.
_TEXT_POSITIVE = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "dense_intermediate_size": "dense_intermediate_size",
    "shared_intermediate_size": "shared_intermediate_size", "num_experts": "num_local_experts",
    "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings",
}
_VISION_POSITIVE = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_channels": "num_channels", "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size", "spatial_merge_size": "spatial_merge_size",
    "layer_norm_eps": "layer_norm_eps", "rope_theta": "rope_theta",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextConfig:
  """Text backbone hyper-parameters (M3_SPEC §1.1). Per-layer layouts are tuples of length num_layers."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int  # one routed expert
  dense_intermediate_size: int
  shared_intermediate_size: int
  num_experts: int
  num_experts_per_tok: int
  routed_scaling_factor: float = 2.0
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  rms_norm_eps: float = 1e-6
  rope_theta: float = 5_000_000.0
  partial_rotary_factor: float = 0.5
  max_position_embeddings: int = 524288
  tie_word_embeddings: bool = False
  attention_types: tuple[AttentionType, ...]
  mlp_types: tuple[MlpType, ...]
  index_num_heads: int
  index_head_dim: int
  index_block_size: int = 128
  index_topk_blocks: int = 16
  index_local_blocks: int = 1
  index_init_blocks: int = 0
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  num_mtp_modules: int = 0

  def __post_init__(self):
    for field, key in _TEXT_POSITIVE.items():
      _check(getattr(self, field) > 0, key, f"must be positive, got {getattr(self, field)}")
    _check(self.num_mtp_modules >= 0, "num_mtp_modules", f"must be >= 0, got {self.num_mtp_modules}")
    _check(self.num_heads % self.num_kv_heads == 0, "num_attention_heads",
           f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
    _check(len(self.attention_types) == self.num_layers, "layer_types",
           f"has {len(self.attention_types)} entries for {self.num_layers} layers")
    _check(len(self.mlp_types) == self.num_layers, "mlp_layer_types",
           f"has {len(self.mlp_types)} entries for {self.num_layers} layers")
    _check(set(self.attention_types) <= {"full", "sparse"}, "layer_types", f"bad values {self.attention_types}")
    _check(set(self.mlp_types) <= {"dense", "moe"}, "mlp_layer_types", f"bad values {self.mlp_types}")
    _check(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
           f"{self.num_experts_per_tok} not in [1, num_experts={self.num_experts}]")
    _check(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor", f"{self.partial_rotary_factor}")
    _check(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "partial_rotary_factor",
           f"gives an odd or empty rotary width {self.rotary_dim} for head_dim {self.head_dim}")
    if "sparse" in self.attention_types:
      _check(self.index_num_heads == self.num_kv_heads, "index_n_heads",
             f"{self.index_num_heads} index heads != {self.num_kv_heads} KV heads (M3 selects per KV group)")
      _check(self.index_head_dim >= self.rotary_dim, "index_head_dim",
             f"{self.index_head_dim} is smaller than the rotary width {self.rotary_dim}")
      _check(self.index_block_size > 0 and self.index_topk_blocks > 0, "index_block_size/index_topk_blocks",
             "must be positive")
      _check(self.index_local_blocks >= 0 and self.index_init_blocks >= 0, "index_local_blocks",
             "forced block counts must be >= 0")
      _check(self.index_local_blocks + self.index_init_blocks <= self.index_topk_blocks, "index_local_blocks",
             f"local {self.index_local_blocks} + init {self.index_init_blocks} forced blocks exceed "
             f"top-k {self.index_topk_blocks}")

  @property
  def rotary_dim(self) -> int:
    """Rotated channels per head: int(head_dim * partial_rotary_factor), as HF and vLLM compute it."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def num_sparse_layers(self) -> int:
    return sum(t == "sparse" for t in self.attention_types)

  @property
  def num_moe_layers(self) -> int:
    return sum(t == "moe" for t in self.mlp_types)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Vision tower + projector hyper-parameters (M3_SPEC §1.2)."""

  hidden_size: int = 1280
  intermediate_size: int = 5120
  num_layers: int = 32
  num_heads: int = 16
  num_channels: int = 3
  patch_size: int = 14
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  layer_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  segment_max_frames: int = 4
  projector_bias: bool = True
  patch_merge_bias: bool = True

  def __post_init__(self):
    for field, key in _VISION_POSITIVE.items():
      _check(getattr(self, field) > 0, f"vision_config.{key}", f"must be positive, got {getattr(self, field)}")
    _check(self.segment_max_frames >= 0, "vision_config.vision_segment_max_frames",
           f"must be >= 0 (0: one segment per video), got {self.segment_max_frames}")
    _check(self.hidden_size % self.num_heads == 0, "vision_config.num_attention_heads",
           f"hidden {self.hidden_size} not divisible by {self.num_heads} heads")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class M3Config:
  """The whole model: text backbone, optional vision tower, multimodal token ids."""

  text: TextConfig
  vision: VisionConfig | None = None
  image_token_id: int = 200025
  video_token_id: int = 200026
  projector_hidden_size: int | None = None

  @property
  def placeholder_ids(self) -> tuple[int, ...]:
    """The image and video placeholder token ids of a vision-language config (each stands for a vision feature),
    () for a text-only one."""
    return (self.image_token_id, self.video_token_id) if self.vision is not None else ()

  @classmethod
  def from_dict(cls, raw: Mapping[str, Any]) -> "M3Config":
    """Parses a checkpoint's config.json (VL or text-only; legacy or HF spelling). The dimensions that shape the
    weights must be given (``REQUIRED_TEXT_KEYS``, and ``REQUIRED_VISION_KEYS`` in a vision_config): a config that
    lacks them is refused rather than filled with the full model's values."""
    if not isinstance(raw, Mapping):
      raise ConfigError(f"the config must be a JSON object, got a JSON {_json_type(raw)}")
    if "text_config" in raw:
      text = _parse_text(_mapping(raw["text_config"], "text_config", allow_none=False), top=raw)
      vision_raw = _mapping(raw.get("vision_config"), "vision_config")
      vision = _parse_vision(vision_raw) if vision_raw is not None else None
    else:
      text = _parse_text(raw, top=raw)
      vision = None
    return cls(
        text=text,
        vision=vision,
        image_token_id=_int(raw.get("image_token_index", raw.get("image_token_id", 200025)), "image_token_index"),
        video_token_id=_int(raw.get("video_token_index", raw.get("video_token_id", 200026)), "video_token_index"),
        projector_hidden_size=(None if raw.get("projector_hidden_size") is None
                               else _int(raw["projector_hidden_size"], "projector_hidden_size")),
    )

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "M3Config":
    """Reads config.json from a file or a checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    try:
      with open(path) as f:
        raw = json.load(f)
    except FileNotFoundError:
      raise FileNotFoundError(f"{path}: no config.json (is this an M3 checkpoint directory?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except IsADirectoryError:
      raise ConfigError(f"{path}: is a directory, not a config.json file") from None
    try:
      return cls.from_dict(raw)
    except ConfigError as e:
      raise ConfigError(f"{path}: {e}") from None

  def to_dict(self) -> dict[str, Any]:
    """A normalised config.json (HF flat spelling plus the keys HF drops, e.g. index_init_blocks)."""
    t = self.text
    text = {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "intermediate_size": t.intermediate_size, "dense_intermediate_size": t.dense_intermediate_size,
        "shared_intermediate_size": t.shared_intermediate_size, "num_local_experts": t.num_experts,
        "num_experts_per_tok": t.num_experts_per_tok, "routed_scaling_factor": t.routed_scaling_factor,
        "swiglu_alpha": t.swiglu_alpha, "swiglu_limit": t.swiglu_limit, "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                            "partial_rotary_factor": t.partial_rotary_factor},
        "rotary_dim": t.rotary_dim, "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": t.tie_word_embeddings, "hidden_act": "swigluoai",
        "layer_types": ["minimax_m3_sparse" if a == "sparse" else "full_attention" for a in t.attention_types],
        "mlp_layer_types": ["sparse" if m == "moe" else "dense" for m in t.mlp_types],
        "index_n_heads": t.index_num_heads, "index_head_dim": t.index_head_dim,
        "index_block_size": t.index_block_size, "index_topk_blocks": t.index_topk_blocks,
        "index_local_blocks": t.index_local_blocks, "index_init_blocks": t.index_init_blocks,
        "bos_token_id": t.bos_token_id, "eos_token_id": list(t.eos_token_ids), "num_mtp_modules": t.num_mtp_modules,
    }
    out: dict[str, Any] = {"model_type": "minimax_m3_vl", "text_config": text,
                           "image_token_index": self.image_token_id, "video_token_index": self.video_token_id}
    if self.projector_hidden_size is not None:
      out["projector_hidden_size"] = self.projector_hidden_size
    if self.vision is not None:
      v = self.vision
      out["vision_config"] = {
          "model_type": "minimax_m3_vl_vision", "hidden_size": v.hidden_size,
          "intermediate_size": v.intermediate_size, "num_hidden_layers": v.num_layers,
          "num_attention_heads": v.num_heads, "num_channels": v.num_channels, "patch_size": v.patch_size,
          "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
          "layer_norm_eps": v.layer_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": v.rope_theta},
          "vision_segment_max_frames": v.segment_max_frames, "multimodal_projector_bias": v.projector_bias,
          "patch_merge_bias": v.patch_merge_bias, "hidden_act": "gelu",
      }
    return out


# ----------------------------------------------------------------------------------------------------------
# Parsing helpers


# The keys that shape the weights; a config without them is refused instead of filled with m3_full()'s values.
REQUIRED_TEXT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size")
REQUIRED_MOE_KEYS = (("num_local_experts", "num_experts"), ("num_experts_per_tok",))
REQUIRED_VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MAX_LAYERS = 4096  # far above any M3; a config asking for more is damaged (and would build huge per-layer lists)


def _check(ok: bool, key: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"config key '{key}': {message}")


def _json_type(value: Any) -> str:
  return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
          type(None): "null"}.get(type(value), type(value).__name__)


def _mapping(value: Any, key: str, allow_none: bool = True) -> Mapping[str, Any] | None:
  """A config sub-object (``text_config``, ``rope_parameters``, ...): a JSON object, or None when absent / null
  (if ``allow_none``); anything else raises ConfigError naming the key."""
  if value is None and allow_none:
    return None
  _check(isinstance(value, Mapping), key, f"must be a JSON object, got {_json_type(value)}"
         + ("" if value is None else f" {value!r:.40}"))
  return value


def _require(raw: Mapping[str, Any], keys: Sequence[str | tuple[str, ...]], where: str) -> None:
  """Raises ConfigError naming every required key (or alternative spellings) that ``raw`` lacks or sets to null."""
  missing = []
  for key in keys:
    names = (key,) if isinstance(key, str) else key
    if all(raw.get(name) is None for name in names):
      missing.append(" / ".join(names))
  if missing:
    raise ConfigError(f"{where} lacks {', '.join(repr(m) for m in missing)}: the dimensions of the weights must be "
                      "given (none is guessed)")


def _int(value: Any, key: str) -> int:
  """A config integer: an int, or a float with an integral value (some writers emit 128.0); anything else (a
  string, a bool, 64.5) raises ConfigError naming the key rather than being coerced or truncated."""
  if isinstance(value, float) and value.is_integer():
    return int(value)
  _check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
  return value


def _float(value: Any, key: str) -> float:
  """A finite config number (int or float, not a string, a bool, NaN or infinity) as a float; raises ConfigError
  naming the key."""
  _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"must be a number, got {value!r}")
  try:
    out = float(value)
  except OverflowError:
    out = math.inf
  _check(math.isfinite(out), key, f"must be a finite number, got {value!r:.40}")
  return out


def _layer_list(raw: Mapping[str, Any], flat_key: str, legacy_values, mapping: dict, n_layers: int,
                legacy_key: str, default: str) -> tuple[str, ...]:
  """Per-layer type list from the HF flat key (strings) or a legacy 0/1 frequency list."""
  if raw.get(flat_key) is not None:
    values = raw[flat_key]
    key = flat_key
  elif legacy_values is not None:
    _check(isinstance(legacy_values, (list, tuple)), legacy_key, f"must be a list, got {_json_type(legacy_values)}")
    values = [mapping[bool(v)] if isinstance(v, (int, bool)) else v for v in legacy_values]
    key = legacy_key
  else:
    return (default,) * n_layers
  _check(isinstance(values, (list, tuple)), key, f"must be a list, got {_json_type(values)}")
  _check(len(values) == n_layers, key, f"has {len(values)} entries but num_hidden_layers is {n_layers}")
  known = {v: v for v in mapping.values()} | {k: v for k, v in mapping.items() if isinstance(k, str)}
  out = []
  for i, v in enumerate(values):
    _check(isinstance(v, str) and v in known, key, f"entry {i} is {v!r:.40}; expected one of {sorted(set(known))}")
    out.append(known[v])
  return tuple(out)


def _parse_text(raw: Mapping[str, Any], top: Mapping[str, Any]) -> TextConfig:
  where = "the config's text_config" if raw is not top else "the config"
  _require(raw, REQUIRED_TEXT_KEYS, where)
  sparse_cfg = _mapping(raw.get("sparse_attention_config"), "sparse_attention_config") or {}
  is_hf_flat = any(k in raw for k in ("layer_types", "mlp_layer_types", "index_n_heads", "rope_parameters"))
  n_layers = _int(raw.get("num_hidden_layers", 60), "num_hidden_layers")
  _check(0 < n_layers <= _MAX_LAYERS, "num_hidden_layers", f"must be in [1, {_MAX_LAYERS}], got {n_layers}")

  def get(flat: str, legacy: str | None = None, default: Any = None) -> Any:
    if flat in raw and raw[flat] is not None:
      return raw[flat]
    if legacy is not None and legacy in sparse_cfg:
      return sparse_cfg[legacy]
    return default

  act = raw.get("hidden_act", "swigluoai")
  _check(act == "swigluoai" or (act == "silu" and is_hf_flat), "hidden_act",
         f"{act!r} is not supported; M3 uses SwiGLU-OAI ('swigluoai'; HF's flat configs rewrite it to 'silu')")
  _check(_float(raw.get("swiglu_beta", 1.0), "swiglu_beta") == 1.0, "swiglu_beta",
         "only 1.0 (the released value) is supported")
  _check(raw.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func",
         f"{raw.get('scoring_func')!r} is not supported; M3 routes with 'sigmoid'")
  _check(bool(raw.get("use_routing_bias", True)), "use_routing_bias", "false is not supported (M3 uses the bias)")
  _check(bool(raw.get("use_gemma_norm", True)), "use_gemma_norm", "only Gemma (1 + w) RMSNorm is supported")
  _check(raw.get("qk_norm_type", "per_head") == "per_head", "qk_norm_type", "only 'per_head' is supported")
  _check(bool(raw.get("use_qk_norm", True)), "use_qk_norm", "only true is supported")
  _check(not raw.get("attention_output_gate", False), "attention_output_gate", "true is not supported")
  _check(bool(raw.get("use_sparse_attention", True)), "use_sparse_attention", "false is not supported")
  score_type = sparse_cfg.get("sparse_score_type", raw.get("sparse_score_type", "max"))
  _check(score_type == "max", "sparse_score_type", f"{score_type!r} is not supported; only 'max' is")

  # RoPE: theta and the rotary fraction may sit at top level (legacy) or in rope_parameters (HF).
  rope = _mapping(raw.get("rope_parameters"), "rope_parameters") or {}
  rope_scaling = raw.get("rope_scaling")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  _check(rope_type == "default" and not rope_scaling, "rope_parameters",
         f"rope type {rope_type!r:.40} / rope_scaling {rope_scaling!r:.60} is not supported (only default RoPE)")
  theta = _float(rope.get("rope_theta", raw.get("rope_theta", 5_000_000.0)), "rope_theta")
  if raw.get("head_dim"):
    head_dim = _int(raw["head_dim"], "head_dim")
  else:
    hidden, heads = _int(raw["hidden_size"], "hidden_size"), _int(raw["num_attention_heads"], "num_attention_heads")
    _check(heads > 0, "num_attention_heads", f"must be positive, got {heads}")
    head_dim = hidden // heads
  _check(head_dim > 0, "head_dim", f"must be positive, got {head_dim}")
  factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
  rotary_dim = raw.get("rotary_dim")
  if factor is None:
    factor = (_int(rotary_dim, "rotary_dim") / head_dim) if rotary_dim is not None else 1.0
  factor = _float(factor, "partial_rotary_factor")
  if rotary_dim is not None:
    _check(_int(rotary_dim, "rotary_dim") == int(head_dim * factor), "rotary_dim",
           f"{rotary_dim} disagrees with head_dim {head_dim} x partial_rotary_factor {factor} "
           f"= {int(head_dim * factor)} (both engines rotate by partial_rotary_factor)")

  attention_types = _layer_list(
      raw, "layer_types", sparse_cfg.get("sparse_attention_freq"),
      {True: "sparse", False: "full", "minimax_m3_sparse": "sparse", "full_attention": "full"},
      n_layers, "sparse_attention_config.sparse_attention_freq", "full")
  mlp_types = _layer_list(
      raw, "mlp_layer_types", raw.get("moe_layer_freq"),
      {True: "moe", False: "dense", "sparse": "moe", "dense": "dense"},
      n_layers, "moe_layer_freq", "moe")
  if "moe" in mlp_types:
    _require(raw, REQUIRED_MOE_KEYS, f"{where} (with MoE layers)")
  disable_iv = sparse_cfg.get("sparse_disable_index_value")
  if disable_iv is not None:
    _check(isinstance(disable_iv, (list, tuple)), "sparse_attention_config.sparse_disable_index_value",
           f"must be a list, got {_json_type(disable_iv)}")
    _check(len(disable_iv) == n_layers, "sparse_attention_config.sparse_disable_index_value",
           f"has {len(disable_iv)} entries but num_hidden_layers is {n_layers}")
    for i, (kind, off) in enumerate(zip(attention_types, disable_iv)):
      _check(kind != "sparse" or bool(off), "sparse_attention_config.sparse_disable_index_value",
             f"layer {i} enables the index-value branch, which M3 checkpoints do not have")

  intermediate = _int(raw.get("intermediate_size", 3072), "intermediate_size")
  n_shared = _int(raw.get("n_shared_experts", 1), "n_shared_experts")
  _check(n_shared >= 1, "n_shared_experts", "M3 has a shared expert; 0 is not supported")
  shared = _int(raw.get("shared_intermediate_size") or intermediate * n_shared, "shared_intermediate_size")
  eos = raw.get("eos_token_id", top.get("eos_token_id"))
  eos_list = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
  eos_ids = tuple(_int(e, "eos_token_id") for e in eos_list)
  bos = raw.get("bos_token_id", top.get("bos_token_id"))

  return TextConfig(
      vocab_size=_int(raw.get("vocab_size", 200064), "vocab_size"),
      hidden_size=_int(raw.get("hidden_size", 6144), "hidden_size"),
      num_layers=n_layers,
      num_heads=_int(raw.get("num_attention_heads", 64), "num_attention_heads"),
      num_kv_heads=_int(raw.get("num_key_value_heads", 4), "num_key_value_heads"),
      head_dim=head_dim,
      intermediate_size=intermediate,
      dense_intermediate_size=_int(raw.get("dense_intermediate_size", 12288), "dense_intermediate_size"),
      shared_intermediate_size=shared,
      num_experts=_int(raw.get("num_local_experts", raw.get("num_experts", 128)), "num_local_experts"),
      num_experts_per_tok=_int(raw.get("num_experts_per_tok", 4), "num_experts_per_tok"),
      routed_scaling_factor=_float(raw.get("routed_scaling_factor", 2.0), "routed_scaling_factor"),
      swiglu_alpha=_float(raw.get("swiglu_alpha", 1.702), "swiglu_alpha"),
      swiglu_limit=_float(raw.get("swiglu_limit", 7.0), "swiglu_limit"),
      rms_norm_eps=_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
      rope_theta=theta,
      partial_rotary_factor=factor,
      max_position_embeddings=_int(raw.get("max_position_embeddings", 524288), "max_position_embeddings"),
      tie_word_embeddings=bool(raw.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
      attention_types=attention_types,
      mlp_types=mlp_types,
      index_num_heads=_int(get("index_n_heads", "sparse_num_index_heads", raw.get("num_key_value_heads", 4)),
                           "index_n_heads"),
      index_head_dim=_int(get("index_head_dim", "sparse_index_dim", 128), "index_head_dim"),
      index_block_size=_int(get("index_block_size", "sparse_block_size", 128), "index_block_size"),
      index_topk_blocks=_int(get("index_topk_blocks", "sparse_topk_blocks", 16), "index_topk_blocks"),
      index_local_blocks=_int(get("index_local_blocks", "sparse_local_block", 1), "index_local_blocks"),
      index_init_blocks=_int(get("index_init_blocks", "sparse_init_block", 0), "index_init_blocks"),
      bos_token_id=None if bos is None else _int(bos, "bos_token_id"),
      eos_token_ids=eos_ids,
      num_mtp_modules=_int(raw.get("num_mtp_modules", 0), "num_mtp_modules"),
  )


def _parse_vision(raw: Mapping[str, Any]) -> VisionConfig:
  _require(raw, REQUIRED_VISION_KEYS, "the config's vision_config")
  compression = _mapping(raw.get("img_token_compression_config"),
                         "vision_config.img_token_compression_config") or {}
  rope = _mapping(raw.get("rope_parameters"), "vision_config.rope_parameters") or {}
  act = raw.get("hidden_act", "gelu")
  _check(act == "gelu", "vision_config.hidden_act", f"{act!r} is not supported (exact-erf 'gelu')")
  proj_act = raw.get("projector_hidden_act", "gelu")
  _check(proj_act == "gelu", "vision_config.projector_hidden_act", f"{proj_act!r} is not supported")
  return VisionConfig(
      hidden_size=_int(raw.get("hidden_size", 1280), "vision_config.hidden_size"),
      intermediate_size=_int(raw.get("intermediate_size", 5120), "vision_config.intermediate_size"),
      num_layers=_int(raw.get("num_hidden_layers", 32), "vision_config.num_hidden_layers"),
      num_heads=_int(raw.get("num_attention_heads", 16), "vision_config.num_attention_heads"),
      num_channels=_int(raw.get("num_channels", 3), "vision_config.num_channels"),
      patch_size=_int(raw.get("patch_size", 14), "vision_config.patch_size"),
      temporal_patch_size=_int(compression.get("temporal_patch_size", raw.get("temporal_patch_size", 2)),
                               "vision_config.temporal_patch_size"),
      spatial_merge_size=_int(compression.get("spatial_merge_size", raw.get("spatial_merge_size", 2)),
                              "vision_config.spatial_merge_size"),
      layer_norm_eps=_float(raw.get("layer_norm_eps", 1e-5), "vision_config.layer_norm_eps"),
      rope_theta=_float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)), "vision_config.rope_theta"),
      segment_max_frames=_int(raw.get("vision_segment_max_frames", 4), "vision_config.vision_segment_max_frames"),
      projector_bias=bool(raw.get("multimodal_projector_bias", True)),
      patch_merge_bias=bool(raw.get("patch_merge_bias", True)),
  )


# ----------------------------------------------------------------------------------------------------------
# Presets


def m3_full() -> M3Config:
  """The released MiniMax-M3 dimensions (≈427B parameters)."""
  text = TextConfig(
      vocab_size=200064, hidden_size=6144, num_layers=60, num_heads=64, num_kv_heads=4, head_dim=128,
      intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
      num_experts=128, num_experts_per_tok=4, attention_types=("full",) * 3 + ("sparse",) * 57,
      mlp_types=("dense",) * 3 + ("moe",) * 57, index_num_heads=4, index_head_dim=128,
      bos_token_id=200034, eos_token_ids=(200020,), num_mtp_modules=1,
  )
  return M3Config(text=text, vision=VisionConfig(), projector_hidden_size=6144)


def tiny(*, block_size: int = 16, vision: bool = False, mtp: bool = False) -> M3Config:
  """A tiny M3 for tests and demos: every layer kind appears (full/sparse x dense/MoE); ``mtp``: one MTP module."""
  text = TextConfig(
      vocab_size=512, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
      intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32, num_experts=8,
      num_experts_per_tok=2, attention_types=("full", "sparse", "sparse", "full"),
      mlp_types=("dense", "moe", "dense", "moe"), index_num_heads=2, index_head_dim=32,
      index_block_size=block_size, index_topk_blocks=2, index_local_blocks=1, bos_token_id=1, eos_token_ids=(2,),
      num_mtp_modules=1 if mtp else 0,
  )
  vis = VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2) if vision else None
  return M3Config(text=text, vision=vis, image_token_id=500, video_token_id=501,
                  projector_hidden_size=64 if vision else None)


PRESETS = {"m3": m3_full, "tiny": tiny}
