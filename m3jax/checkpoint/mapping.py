"""Checkpoint tensor names <-> m3jax parameter paths, with invertible transforms.

Three checkpoint layouts (M3_SPEC §4-5):
  * ``original``: what MiniMax releases and HF ``save_pretrained`` writes
    (``language_model.model.layers.N.block_sparse_moe.experts.E.w1.weight`` ...).
  * ``hf``: HF transformers' in-memory VL layout (``model.language_model.layers.N.mlp.experts.gate_up_proj``).
  * ``hf_text``: HF's text-only ``MiniMaxM3VLForCausalLM`` (``model.layers.N...``, ``lm_head.weight``).
Checkpoint linears are [out, in]; m3jax stores [in, out] (heads split out), so most transforms transpose
(``transpose_last2``: the same result as ``np.ascontiguousarray(x.T)``, ~4x faster on large matrices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from m3jax.checkpoint.fastops import transpose_last2
from m3jax.config import TextConfig

Layout = Literal["original", "hf", "hf_text"]
LAYOUTS: tuple[Layout, ...] = ("original", "hf", "hf_text")
ParamPath = tuple[str | int, ...]

# Tensors that belong to other parts of the model (vision tower, MTP) and are skipped by the text loader.
_SKIPPED_PREFIXES = {
    "original": ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "language_model.model.mtp."),
    "hf": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.mtp.", "mtp."),
    "hf_text": ("model.mtp.", "mtp."),
}


@dataclasses.dataclass(frozen=True)
class TensorRule:
  """One m3jax parameter built from one or more checkpoint tensors.

  to_param(list of source arrays) -> parameter array; from_param(parameter) -> list of source arrays.
  fp8_groups: how the parameter kept in fp8 (``m3jax.layers.quantized``: [*batch, out, in], no transpose) is
  assembled from its linear sources [..., out, in]: each group of source indices is concatenated along ``out``,
  and with ``fp8_stacked`` the groups are stacked along a new leading (experts) axis (otherwise there is one
  group). None for a parameter that is not a linear weight.
  """

  path: ParamPath
  sources: tuple[str, ...]
  source_shapes: tuple[tuple[int, ...], ...]
  to_param: Callable[[Sequence[np.ndarray]], np.ndarray]
  from_param: Callable[[np.ndarray], list[np.ndarray]]
  fp8_groups: tuple[tuple[int, ...], ...] | None = None
  fp8_stacked: bool = False


def _copy(path, name, shape) -> TensorRule:
  return TensorRule(path, (name,), (shape,), lambda s: s[0], lambda p: [p])


def _linear(path, name, out_in: tuple[int, int], param_shape: tuple[int, ...]) -> TensorRule:
  """Checkpoint [out, in] <-> m3jax param = W.T reshaped to param_shape (e.g. [in, heads, dim])."""
  return TensorRule(path, (name,), (out_in,),
                    lambda s: transpose_last2(s[0]).reshape(param_shape),
                    lambda p: [transpose_last2(p.reshape(out_in[::-1]))], fp8_groups=((0,),))


def _gate_up(path, gate: str, up: str, width: int, hidden: int) -> TensorRule:
  """gate [F, H] and up [F, H] <-> gate_up [H, 2F] (gate columns first)."""
  def to_param(s):
    out = np.empty((hidden, 2 * width), np.result_type(s[0], s[1]))
    transpose_last2(s[0], out=out[:, :width])
    transpose_last2(s[1], out=out[:, width:])
    return out

  return TensorRule(path, (gate, up), ((width, hidden), (width, hidden)), to_param,
                    lambda p: [transpose_last2(p[:, :width]), transpose_last2(p[:, width:])], fp8_groups=((0, 1),))


def _expert_gate_up(path, w1: list[str], w3: list[str], width: int, hidden: int) -> TensorRule:
  """Per-expert w1 (gate) [I, H] and w3 (up) [I, H] <-> [E, H, 2I]."""
  e = len(w1)

  def to_param(s):
    out = np.empty((e, hidden, 2 * width), np.result_type(*s))
    for i in range(e):
      transpose_last2(s[i], out=out[i, :, :width])
      transpose_last2(s[e + i], out=out[i, :, width:])
    return out

  def from_param(p):
    return ([transpose_last2(p[i, :, :width]) for i in range(e)]
            + [transpose_last2(p[i, :, width:]) for i in range(e)])

  return TensorRule(path, tuple(w1 + w3), ((width, hidden),) * (2 * e), to_param, from_param,
                    fp8_groups=tuple((i, e + i) for i in range(e)), fp8_stacked=True)


def _expert_down(path, w2: list[str], width: int, hidden: int) -> TensorRule:
  """Per-expert w2 (down) [H, I] <-> [E, I, H]."""
  e = len(w2)

  def to_param(s):
    out = np.empty((e, width, hidden), np.result_type(*s))
    for i in range(e):
      transpose_last2(s[i], out=out[i])
    return out

  return TensorRule(path, tuple(w2), ((hidden, width),) * e, to_param,
                    lambda p: [transpose_last2(p[i]) for i in range(e)], fp8_groups=tuple((i,) for i in range(e)),
                    fp8_stacked=True)


def _stacked_transpose(path, name, shape: tuple[int, int, int]) -> TensorRule:
  """HF stacked experts [E, out, in] <-> [E, in, out]."""
  return TensorRule(path, (name,), (shape,),
                    lambda s: transpose_last2(s[0]),
                    lambda p: [transpose_last2(p)], fp8_groups=((0,),))


def _hf_gate_up(path, name, width: int, hidden: int) -> TensorRule:
  """HF fused gate_up_proj.weight [2F, H] <-> [H, 2F]."""
  return _linear(path, name, (2 * width, hidden), (hidden, 2 * width))


def prefixes(layout: Layout) -> tuple[str, str]:
  """(backbone prefix, lm_head name) of a layout."""
  return {
      "original": ("language_model.model.", "language_model.lm_head.weight"),
      "hf": ("model.language_model.", "lm_head.weight"),
      "hf_text": ("model.", "lm_head.weight"),
  }[layout]


def text_rules(cfg: TextConfig, layout: Layout) -> list[TensorRule]:
  """Every text-backbone parameter of ``cfg`` and where it lives in a ``layout`` checkpoint."""
  if layout not in LAYOUTS:
    raise ValueError(f"unknown checkpoint layout {layout!r}; expected one of {LAYOUTS}")
  pre, head_name = prefixes(layout)
  h = cfg.hidden_size
  rules = [
      _copy(("embed",), pre + "embed_tokens.weight", (cfg.vocab_size, h)),
      _copy(("final_norm", "weight"), pre + "norm.weight", (h,)),
  ]
  if not cfg.tie_word_embeddings:
    rules.append(_linear(("lm_head",), head_name, (cfg.vocab_size, h), (h, cfg.vocab_size)))
  for n in range(cfg.num_layers):
    rules += decoder_layer_rules(cfg, layout, f"{pre}layers.{n}.", ("layers", n),
                                 sparse=cfg.attention_types[n] == "sparse", moe=cfg.mlp_types[n] == "moe")
  return rules


def decoder_layer_rules(cfg: TextConfig, layout: Layout, lp: str, base: ParamPath, *, sparse: bool, moe: bool
                        ) -> list[TensorRule]:
  """The rules of one decoder layer whose checkpoint names start with ``lp`` ('...layers.3.') and whose parameters
  live under ``base`` (('layers', 3)); ``sparse`` / ``moe`` select the attention and MLP kinds."""
  h, nq, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  hi, di, e, i_w = cfg.index_num_heads, cfg.index_head_dim, cfg.num_experts, cfg.intermediate_size
  original = layout == "original"
  at = base + ("attn",)
  rules = [
      _copy(base + ("input_norm", "weight"), lp + "input_layernorm.weight", (h,)),
      _copy(base + ("post_attention_norm", "weight"), lp + "post_attention_layernorm.weight", (h,)),
      _linear(at + ("q_proj",), lp + "self_attn.q_proj.weight", (nq * d, h), (h, nq, d)),
      _linear(at + ("k_proj",), lp + "self_attn.k_proj.weight", (nkv * d, h), (h, nkv, d)),
      _linear(at + ("v_proj",), lp + "self_attn.v_proj.weight", (nkv * d, h), (h, nkv, d)),
      _linear(at + ("o_proj",), lp + "self_attn.o_proj.weight", (h, nq * d), (nq, d, h)),
      _copy(at + ("q_norm", "weight"), lp + "self_attn.q_norm.weight", (d,)),
      _copy(at + ("k_norm", "weight"), lp + "self_attn.k_norm.weight", (d,)),
  ]
  if sparse:
    ix = at + ("indexer",)
    name = (lambda s: f"{lp}self_attn.index_{s}.weight") if original else (
        lambda s: f"{lp}self_attn.indexer.{s}.weight")
    rules += [
        _linear(ix + ("q_proj",), name("q_proj"), (hi * di, h), (h, hi, di)),
        _linear(ix + ("k_proj",), name("k_proj"), (di, h), (h, di)),
        _copy(ix + ("q_norm", "weight"), name("q_norm"), (di,)),
        _copy(ix + ("k_norm", "weight"), name("k_norm"), (di,)),
    ]
  mp = base + ("mlp",)
  if not moe:
    f = cfg.dense_intermediate_size
    if original:
      rules.append(_gate_up(mp + ("gate_up",), lp + "mlp.gate_proj.weight", lp + "mlp.up_proj.weight", f, h))
    else:
      rules.append(_hf_gate_up(mp + ("gate_up",), lp + "mlp.gate_up_proj.weight", f, h))
    rules.append(_linear(mp + ("down",), lp + "mlp.down_proj.weight", (h, f), (f, h)))
    return rules
  s_w = cfg.shared_intermediate_size
  if original:
    moe_pre = lp + "block_sparse_moe."
    rules += [
        _linear(mp + ("router",), moe_pre + "gate.weight", (e, h), (h, e)),
        _copy(mp + ("correction_bias",), moe_pre + "e_score_correction_bias", (e,)),
        _expert_gate_up(mp + ("w_gate_up",), [f"{moe_pre}experts.{j}.w1.weight" for j in range(e)],
                        [f"{moe_pre}experts.{j}.w3.weight" for j in range(e)], i_w, h),
        _expert_down(mp + ("w_down",), [f"{moe_pre}experts.{j}.w2.weight" for j in range(e)], i_w, h),
        _gate_up(mp + ("shared", "gate_up"), moe_pre + "shared_experts.gate_proj.weight",
                 moe_pre + "shared_experts.up_proj.weight", s_w, h),
        _linear(mp + ("shared", "down"), moe_pre + "shared_experts.down_proj.weight", (h, s_w), (s_w, h)),
    ]
  else:
    moe_pre = lp + "mlp."
    rules += [
        _linear(mp + ("router",), moe_pre + "gate.weight", (e, h), (h, e)),
        _copy(mp + ("correction_bias",), moe_pre + "gate.e_score_correction_bias", (e,)),
        _stacked_transpose(mp + ("w_gate_up",), moe_pre + "experts.gate_up_proj", (e, 2 * i_w, h)),
        _stacked_transpose(mp + ("w_down",), moe_pre + "experts.down_proj", (e, h, i_w)),
        _hf_gate_up(mp + ("shared", "gate_up"), moe_pre + "shared_experts.gate_up_proj.weight", s_w, h),
        _linear(mp + ("shared", "down"), moe_pre + "shared_experts.down_proj.weight", (h, s_w), (s_w, h)),
    ]
  return rules


# The MTP modules' tensors in an original-layout checkpoint (M3_SPEC §5.1, §8), and relative to 'mtp.' in the
# 'mtp' subtree of a converted checkpoint.
MTP_PREFIX = "language_model.model.mtp."


def mtp_rules(cfg: TextConfig, prefix: str = MTP_PREFIX) -> list[TensorRule]:
  """The rules of the ``num_mtp_modules`` MTP modules (parameters under ('mtp', i)), with checkpoint names
  ``{prefix}layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` and ``{prefix}layers.{i}.transformer_layer.*``
  (a sparse + MoE layer, original sub-names). Only original-layout checkpoints carry them (HF drops them on load)."""
  h = cfg.hidden_size
  rules: list[TensorRule] = []
  for i in range(cfg.num_mtp_modules):
    lp, base = f"{prefix}layers.{i}.", ("mtp", i)
    rules += [
        _copy(base + ("enorm", "weight"), lp + "enorm.weight", (h,)),
        _copy(base + ("hnorm", "weight"), lp + "hnorm.weight", (h,)),
        _linear(base + ("eh_proj",), lp + "eh_proj.weight", (h, 2 * h), (2 * h, h)),
        _copy(base + ("final_norm", "weight"), lp + "final_layernorm.weight", (h,)),
    ]
    rules += decoder_layer_rules(cfg, "original", lp + "transformer_layer.", base + ("layer",), sparse=True, moe=True)
  return rules


def detect_layout(names: Sequence[str]) -> Layout:
  """Which layout a checkpoint's tensor names follow."""
  names = list(names)
  if any(n.startswith("language_model.model.") for n in names):
    return "original"
  if any(n.startswith("model.language_model.") for n in names):
    return "hf"
  if any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in names):
    return "hf_text"
  sample = ", ".join(sorted(names)[:3])
  raise ValueError(f"cannot recognise the checkpoint layout from its tensor names (e.g. {sample})")


def is_skipped(name: str, layout: Layout) -> bool:
  """True for tensors the text backbone does not use (vision tower, projector, MTP)."""
  return name.startswith(_SKIPPED_PREFIXES[layout]) or ".mtp." in name


# Stacked-expert parameters ([E, ...]); conversion streams them a few experts at a time.
EXPERT_PARAMS = ("w_gate_up", "w_down")


def num_stacked_experts(rule: TensorRule) -> int:
  """E for a stacked-expert rule ([E, H, 2I] gate_up or [E, I, H] down), 0 for any other rule."""
  if rule.path[-1] not in EXPERT_PARAMS:
    return 0
  if len(rule.source_shapes[0]) == 3:  # one stacked HF tensor [E, out, in]
    return rule.source_shapes[0][0]
  return len(rule.sources) // 2 if rule.path[-1] == "w_gate_up" else len(rule.sources)


def expert_subrule(rule: TensorRule, start: int, stop: int) -> tuple[TensorRule, slice | None]:
  """Experts [start, stop) of a stacked-expert rule.

  Returns (a rule whose to_param gives param[start:stop] and whose from_param inverts it, the leading-axis row
  slice to read from each source tensor or None when the sources are per-expert tensors).
  """
  e = num_stacked_experts(rule)
  if not e or not 0 <= start < stop <= e:
    raise ValueError(f"expert range [{start}, {stop}) of {'/'.join(map(str, rule.path))} (experts: {e})")
  if len(rule.source_shapes[0]) == 3:
    shape = (stop - start,) + tuple(rule.source_shapes[0][1:])
    return dataclasses.replace(rule, source_shapes=(shape,)), slice(start, stop)
  if rule.path[-1] == "w_gate_up":
    width, hidden = rule.source_shapes[0]
    w1, w3 = list(rule.sources[:e]), list(rule.sources[e:])
    return _expert_gate_up(rule.path, w1[start:stop], w3[start:stop], width, hidden), None
  hidden, width = rule.source_shapes[0]
  return _expert_down(rule.path, list(rule.sources[start:stop]), width, hidden), None
