"""Config parsing: both spellings, rotary width, validation errors, presets."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3jax.config import ConfigError, M3Config, m3_full, tiny

pytestmark = pytest.mark.quick  # a cheap file: all of it is in the quick tier

FLAT = {
    "model_type": "minimax_m3_vl",
    "text_config": {
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 32, "dense_intermediate_size": 96,
        "shared_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
        "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                  "partial_rotary_factor": 0.5},
        "rotary_dim": 16,
        "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        "index_n_heads": 2, "index_head_dim": 32, "index_block_size": 128, "index_topk_blocks": 2,
        "index_local_blocks": 1, "eos_token_id": 2,
    },
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "intermediate_size": 64},
    "image_token_index": 250,
}

LEGACY = {
    "model_type": "minimax_m3_vl",
    "text_config": {
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 32, "dense_intermediate_size": 96,
        "n_shared_experts": 1, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "swigluoai",
        "rope_theta": 5e6, "partial_rotary_factor": 0.5, "rotary_dim": 16, "scoring_func": "sigmoid",
        "use_routing_bias": True, "use_gemma_norm": True, "qk_norm_type": "per_head", "use_qk_norm": True,
        "attention_output_gate": False, "moe_layer_freq": [0, 1, 0, 1], "eos_token_id": [2],
        "sparse_attention_config": {
            "sparse_attention_freq": [0, 1, 1, 0], "sparse_num_index_heads": 2, "sparse_index_dim": 32,
            "sparse_block_size": 128, "sparse_topk_blocks": 2, "sparse_local_block": 1, "sparse_init_block": 0,
            "sparse_score_type": "max", "sparse_disable_index_value": [0, 1, 1, 0],
        },
        "some_future_key": {"tolerated": True},
    },
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "intermediate_size": 64, "img_token_compression_config": {"temporal_patch_size": 2,
                                                                                "spatial_merge_size": 2}},
    "image_token_index": 250,
}


def _with(base, **text_updates):
  cfg = json.loads(json.dumps(base))
  for k, v in text_updates.items():
    if v is None:
      cfg["text_config"].pop(k, None)
    else:
      cfg["text_config"][k] = v
  return cfg


def test_legacy_and_flat_spellings_give_the_same_config():
  assert M3Config.from_dict(LEGACY) == M3Config.from_dict(FLAT)


def test_parsed_values():
  t = M3Config.from_dict(LEGACY).text
  assert t.attention_types == ("full", "sparse", "sparse", "full")
  assert t.mlp_types == ("dense", "moe", "dense", "moe")
  assert t.rotary_dim == 16 and t.shared_intermediate_size == 32 and t.eos_token_ids == (2,)
  assert t.index_block_size == 128 and t.index_init_blocks == 0


def test_rotary_width_follows_partial_rotary_factor():
  cfg = _with(FLAT, rotary_dim=None)
  cfg["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.25
  assert M3Config.from_dict(cfg).text.rotary_dim == 8
  only_rotary_dim = _with(LEGACY, partial_rotary_factor=None, rotary_dim=8)
  assert M3Config.from_dict(only_rotary_dim).text.rotary_dim == 8


def test_sparse_init_block_is_kept():
  cfg = json.loads(json.dumps(LEGACY))
  cfg["text_config"]["sparse_attention_config"]["sparse_init_block"] = 1
  assert M3Config.from_dict(cfg).text.index_init_blocks == 1


@pytest.mark.parametrize("updates, key", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rotary_dim": 24}, "rotary_dim"),
    ({"moe_layer_freq": [0, 1, 1]}, "moe_layer_freq"),
    ({"num_key_value_heads": 3}, "num_attention_heads"),
    ({"use_routing_bias": False}, "use_routing_bias"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_parameters"),
    ({"swiglu_beta": 2.0}, "swiglu_beta"),
])
def test_unsupported_or_inconsistent_values_raise_naming_the_key(updates, key):
  with pytest.raises(ConfigError, match=key):
    M3Config.from_dict(_with(LEGACY, **updates))


@pytest.mark.parametrize("sparse_updates, key", [
    ({"sparse_score_type": "mean"}, "sparse_score_type"),
    ({"sparse_num_index_heads": 4}, "index_n_heads"),
    ({"sparse_attention_freq": [0, 1, 1]}, "sparse_attention_freq"),
    ({"sparse_disable_index_value": [0, 0, 1, 0]}, "sparse_disable_index_value"),
    ({"sparse_local_block": 2, "sparse_init_block": 1}, "index_local_blocks"),
])
def test_bad_sparse_attention_config(sparse_updates, key):
  cfg = json.loads(json.dumps(LEGACY))
  cfg["text_config"]["sparse_attention_config"].update(sparse_updates)
  with pytest.raises(ConfigError, match=key):
    M3Config.from_dict(cfg)


@pytest.mark.parametrize("updates, message", [
    ({"hidden_size": 64.5}, "config key 'hidden_size': must be an integer, got 64.5"),
    ({"hidden_size": "64"}, "config key 'hidden_size': must be an integer, got '64'"),
    ({"num_local_experts": True}, "config key 'num_local_experts': must be an integer, got True"),
    ({"rms_norm_eps": "1e-6"}, "config key 'rms_norm_eps': must be a number, got '1e-6'"),
    ({"num_key_value_heads": 0}, "config key 'num_key_value_heads': must be positive, got 0"),
    ({"vocab_size": -5}, "config key 'vocab_size': must be positive, got -5"),
    ({"eos_token_id": [2, 2.5]}, "config key 'eos_token_id': must be an integer, got 2.5"),
    ({"rotary_dim": "16"}, "config key 'rotary_dim': must be an integer"),
])
def test_values_of_the_wrong_type_or_sign_raise_instead_of_being_coerced(updates, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
    M3Config.from_dict(_with(LEGACY, **updates))


def test_integral_floats_are_integers_and_bad_vision_values_name_the_vision_key():
  cfg = M3Config.from_dict(_with(LEGACY, hidden_size=64.0, max_position_embeddings=1.6e4))
  assert cfg.text.hidden_size == 64 and isinstance(cfg.text.hidden_size, int)
  assert cfg.text.max_position_embeddings == 16000
  bad = json.loads(json.dumps(LEGACY))
  bad["vision_config"]["patch_size"] = 14.5
  with pytest.raises(ConfigError, match="'vision_config.patch_size': must be an integer, got 14.5"):
    M3Config.from_dict(bad)
  bad["vision_config"]["patch_size"] = 0
  with pytest.raises(ConfigError, match="'vision_config.patch_size': must be positive, got 0"):
    M3Config.from_dict(bad)
  ok = json.loads(json.dumps(LEGACY))
  ok["vision_config"]["vision_segment_max_frames"] = 0  # one segment per video
  assert M3Config.from_dict(ok).vision.segment_max_frames == 0
  ok["vision_config"]["vision_segment_max_frames"] = -1
  with pytest.raises(ConfigError, match="'vision_config.vision_segment_max_frames': must be >= 0"):
    M3Config.from_dict(ok)


def test_silu_is_only_accepted_from_hf_flat_configs():
  with pytest.raises(ConfigError, match="hidden_act"):
    M3Config.from_dict(_with(LEGACY, hidden_act="silu"))


def test_from_file_names_the_file(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(_with(LEGACY, hidden_act="relu")))
  with pytest.raises(ConfigError, match=str(tmp_path)):
    M3Config.from_file(tmp_path)
  with pytest.raises(FileNotFoundError, match="config.json"):
    M3Config.from_file(tmp_path / "nowhere")


def test_to_dict_round_trips():
  for cfg in (M3Config.from_dict(LEGACY), m3_full(), tiny(vision=True)):
    assert M3Config.from_dict(cfg.to_dict()) == cfg


def test_full_preset_matches_the_released_dims():
  t = m3_full().text
  assert (t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim) == (6144, 60, 64, 4, 128)
  assert t.rotary_dim == 64 and t.num_sparse_layers == 57 and t.num_moe_layers == 57
  assert (t.num_experts, t.num_experts_per_tok, t.index_topk_blocks, t.index_block_size) == (128, 4, 16, 128)


def test_an_empty_or_malformed_config_names_what_is_missing():
  """#45: config.json = {} parsed as the full 427B model; a JSON list or text_config: null gave a traceback."""
  with pytest.raises(ConfigError, match="the config lacks 'vocab_size', 'hidden_size', 'num_hidden_layers', "
                                        "'num_attention_heads', 'num_key_value_heads', 'intermediate_size'"):
    M3Config.from_dict({})
  with pytest.raises(ConfigError, match="the config must be a JSON object, got a JSON array"):
    M3Config.from_dict([1, 2])
  with pytest.raises(ConfigError, match="config key 'text_config': must be a JSON object, got null"):
    M3Config.from_dict({"text_config": None})
  with pytest.raises(ConfigError, match=r"text_config \(with MoE layers\) lacks 'num_local_experts / num_experts'"):
    M3Config.from_dict(_with(LEGACY, num_local_experts=None))
  bad_vision = json.loads(json.dumps(LEGACY))
  bad_vision["vision_config"] = {}
  with pytest.raises(ConfigError, match="vision_config lacks 'hidden_size', 'intermediate_size'"):
    M3Config.from_dict(bad_vision)
  for updates, key in (({"rope_parameters": [1]}, "rope_parameters"), ({"sparse_attention_config": 3},
                                                                        "sparse_attention_config"),
                       ({"rms_norm_eps": float("nan")}, "rms_norm_eps"), ({"num_attention_heads": 0, "head_dim": None},
                                                                          "num_attention_heads"),
                       ({"moe_layer_freq": [[0], 1, 0, 1]}, "moe_layer_freq"), ({"num_hidden_layers": 10**12},
                                                                                "num_hidden_layers")):
    with pytest.raises(ConfigError, match=key):
      M3Config.from_dict(_with(LEGACY, **updates))


def test_from_file_refuses_json_that_is_not_an_object(tmp_path):
  for text, message in (("[1, 2]", "must be a JSON object, got a JSON array"), ('{"text_config": null}', "null"),
                        ("{", "not valid JSON"), ("{}", "lacks 'vocab_size'")):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
      M3Config.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


# Properties (hypothesis): any JSON shape, and any corruption of a valid config, parses or raises ConfigError.
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=6), st.sampled_from(["silu", "swigluoai", "default", "sparse", "dense",
                                                           "full_attention", "minimax_m3_sparse", "sigmoid"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                     max_leaves=16)
_TEXT_KEYS = sorted(set(FLAT["text_config"]) | set(LEGACY["text_config"]) | {"head_dim", "rope_scaling"})


def _parses_or_config_error(raw):
  try:
    cfg = M3Config.from_dict(raw)
  except ConfigError as e:
    assert str(e) and "\n" not in str(e)
    return None
  assert isinstance(cfg, M3Config)
  return cfg


@settings(max_examples=100, deadline=None)
@given(raw=_JSON)
def test_any_json_shape_parses_or_raises_config_error(raw):
  _parses_or_config_error(raw)
  _parses_or_config_error({"text_config": raw, "vision_config": raw})


@settings(max_examples=100, deadline=None)
@given(base=st.sampled_from([FLAT, LEGACY]), edits=st.lists(st.tuples(st.sampled_from(_TEXT_KEYS), _JSON),
                                                            min_size=1, max_size=3),
       vision=st.one_of(st.none(), _JSON), drop=st.lists(st.sampled_from(_TEXT_KEYS), max_size=2))
def test_corrupted_configs_parse_or_raise_config_error(base, edits, vision, drop):
  raw = json.loads(json.dumps(base))
  for key, value in edits:
    raw["text_config"][key] = value
  for key in drop:
    raw["text_config"].pop(key, None)
  raw["vision_config"] = vision
  cfg = _parses_or_config_error(raw)
  if cfg is not None:  # what parses round-trips
    assert M3Config.from_dict(cfg.to_dict()) == cfg
