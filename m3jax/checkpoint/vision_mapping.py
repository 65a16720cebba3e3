"""Vision tower + projector tensor names <-> m3jax parameter paths (M3_SPEC §5.1-5.2).

Two layouts carry vision tensors:
  * ``original`` (MiniMax release / HF save_pretrained): ``vision_tower.vision_model.{embeddings.patch_embedding,
    pre_layrnorm, encoder.layers.N.*}``, ``multi_modal_projector.linear_{1,2}``, ``patch_merge_mlp.linear_{1,2}``.
  * ``hf`` (HF in-memory): ``model.vision_tower.{embeddings.proj, pre_layrnorm, layers.N.*}``,
    ``model.multi_modal_projector.{linear_1, linear_2, merge_linear_1, merge_linear_2}``.
The text-only ``hf_text`` layout has none. Linears are [out, in] in checkpoints and [in, out] in m3jax; the
Conv3d patch embedding [D, C, T, P, P] becomes a [C*T*P*P, D] matmul weight.
"""

from __future__ import annotations

import numpy as np

from m3jax.checkpoint.mapping import Layout, TensorRule, _copy, _linear
from m3jax.config import M3Config

VISION_LAYOUTS: tuple[Layout, ...] = ("original", "hf")


def _names(layout: Layout) -> dict[str, str]:
  if layout == "original":
    return dict(patch="vision_tower.vision_model.embeddings.patch_embedding.weight",
                pre="vision_tower.vision_model.pre_layrnorm.",
                layer="vision_tower.vision_model.encoder.layers.{n}.",
                linear_1="multi_modal_projector.linear_1.", linear_2="multi_modal_projector.linear_2.",
                merge_linear_1="patch_merge_mlp.linear_1.", merge_linear_2="patch_merge_mlp.linear_2.")
  if layout == "hf":
    return dict(patch="model.vision_tower.embeddings.proj.weight", pre="model.vision_tower.pre_layrnorm.",
                layer="model.vision_tower.layers.{n}.",
                linear_1="model.multi_modal_projector.linear_1.", linear_2="model.multi_modal_projector.linear_2.",
                merge_linear_1="model.multi_modal_projector.merge_linear_1.",
                merge_linear_2="model.multi_modal_projector.merge_linear_2.")
  raise ValueError(f"a {layout!r} checkpoint has no vision tensors (vision layouts: {VISION_LAYOUTS}), but config.json "
                   "has a vision_config; load with text_only=True")


def _patch_embed(path, name, dim: int, conv_shape: tuple[int, ...]) -> TensorRule:
  """Conv3d weight [D, C, T, P, P] <-> matmul weight [C*T*P*P, D] (rows in the pixel-row order C, T, py, px)."""
  flat = int(np.prod(conv_shape))
  return TensorRule(path, (name,), ((dim, *conv_shape),),
                    lambda s: np.ascontiguousarray(s[0].reshape(dim, flat).T),
                    lambda p: [np.ascontiguousarray(p.T).reshape(dim, *conv_shape)])


def _biased(path, prefix: str, out_in: tuple[int, int], param_shape: tuple[int, ...], bias: bool = True
            ) -> list[TensorRule]:
  """A linear (+ bias) ``prefix``weight [out, in] / ``prefix``bias [out]; the bias keeps param_shape[1:]."""
  rules = [_linear(path + ("weight",), prefix + "weight", out_in, param_shape)]
  if bias:
    bias_shape = param_shape[1:]
    rules.append(TensorRule(path + ("bias",), (prefix + "bias",), ((out_in[0],),),
                            lambda s: s[0].reshape(bias_shape), lambda p: [p.reshape(-1)]))
  return rules


def vision_rules(config: M3Config, layout: Layout) -> list[TensorRule]:
  """Every parameter of ``M3ForCausalLM.vision`` and where it lives in a ``layout`` checkpoint."""
  v = config.vision
  if v is None:
    raise ValueError("config has no vision_config, so there are no vision tensors to map")
  names = _names(layout)
  d, nh, hd, width = v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size
  h = config.text.hidden_size
  p = config.projector_hidden_size or h
  merged = v.spatial_merge_size ** 2 * h
  tower = ("vision", "tower")
  conv = (v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
  rules = [
      _patch_embed(tower + ("patch_embed",), names["patch"], d, conv),
      _copy(tower + ("pre_norm", "weight"), names["pre"] + "weight", (d,)),
      _copy(tower + ("pre_norm", "bias"), names["pre"] + "bias", (d,)),
  ]
  for n in range(v.num_layers):
    lp, tp = names["layer"].format(n=n), tower + ("layers", n)
    for norm_name, norm in (("layer_norm1", "norm1"), ("layer_norm2", "norm2")):
      rules += [_copy(tp + (norm, "weight"), f"{lp}{norm_name}.weight", (d,)),
                _copy(tp + (norm, "bias"), f"{lp}{norm_name}.bias", (d,))]
    for proj in ("q_proj", "k_proj", "v_proj"):
      rules += _biased(tp + ("attn", proj), f"{lp}self_attn.{proj}.", (d, d), (d, nh, hd))
    rules += _biased(tp + ("attn", "out_proj"), f"{lp}self_attn.out_proj.", (d, d), (d, d))
    rules += _biased(tp + ("mlp", "fc1"), f"{lp}mlp.fc1.", (width, d), (d, width))
    rules += _biased(tp + ("mlp", "fc2"), f"{lp}mlp.fc2.", (d, width), (width, d))
  proj = ("vision", "projector")
  rules += _biased(proj + ("linear_1",), names["linear_1"], (p, d), (d, p), v.projector_bias)
  rules += _biased(proj + ("linear_2",), names["linear_2"], (h, p), (p, h), v.projector_bias)
  rules += _biased(proj + ("merge_linear_1",), names["merge_linear_1"], (p, merged), (merged, p), v.patch_merge_bias)
  rules += _biased(proj + ("merge_linear_2",), names["merge_linear_2"], (h, p), (p, h), v.patch_merge_bias)
  return rules


def has_vision_tensors(names, layout: Layout) -> bool:
  """True when any tensor name belongs to the vision tower or projector of ``layout``."""
  if layout not in VISION_LAYOUTS:
    return False
  n = _names(layout)
  prefixes = (n["patch"].split("embeddings")[0], n["linear_1"].rsplit("linear_1", 1)[0],
              n["merge_linear_1"].rsplit("linear_1", 1)[0])
  return any(name.startswith(prefixes) for name in names)
