"""Build golden HF-reference fixtures for the MiniMax M3 text model.

For every fixture this script

1. builds a tiny random ``MiniMaxM3SparseForConditionalGeneration`` (text + vision) in fp32 / eager,
   re-initialising everything HF leaves at zero/one (RMSNorm offsets, the router correction bias) and using a
   larger projection std so that logits, MoE routing and indexer block selection are all non-degenerate;
2. checks the robustness of every discrete decision HF makes (indexer top-k blocks, router top-k experts,
   greedy argmax) and moves to the next seed if any of them is a near-tie;
3. saves a sharded checkpoint in the original MiniMax layout (``language_model.model.layers.N...``), verifies
   the tensor names and the expert/MLP packing, adds a fake ``mtp.*`` tensor (loaders must skip it), optionally
   rewrites ``config.json`` into the released/legacy MiniMax spelling, and reloads it with ``from_pretrained``
   to prove the files reproduce the in-memory logits bit for bit;
4. writes ``reference.npz`` (input_ids, logits, gen_prompt_lens, gen_tokens) and ``meta.json``.

``--gradients NAME ...`` instead reloads committed fixtures and writes ``gradients.npz`` beside them (the training
references of m3jax.training, tests/test_training_losses.py): HF's loss with ``labels=input_ids`` and torch
autograd's gradients of it for a few parameters under their HF in-memory names (``grad/<name>``; a parameter the
loss does not reach, such as the indexer's, is stored as zeros and listed in ``no_grad``), plus the indexer
alignment loss of m3jax.training restated in torch on HF's modules (per sparse layer, dense and sparse phase)
with its gradients of that layer's indexer projections.

Run with the HF reference venv (torch CPU + transformers 5.23.0), from the repository root::

  /tmp/venvref/bin/python scripts/make_hf_fixtures.py --out-dir tests/fixtures
  /tmp/venvref/bin/python scripts/make_hf_fixtures.py --out-dir tests/fixtures --gradients flat_b16

This file is a generator only; tests never import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers
from transformers import GenerationConfig, MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3

GEN_NEW_TOKENS = 48
MIN_INDEX_REL_GAP = 1e-4  # min (T-th - (T+1)-th best non-forced block score) / row score scale
MIN_ROUTER_GAP = 3e-5  # min (K-th - (K+1)-th best router choice score), sigmoid units
MIN_ARGMAX_MARGIN = 1e-4  # min (top1 - top2) logit during greedy generation
MIN_DISTINCT_GEN = 12  # reject seeds whose greedy continuation collapses into a repeated token
MTP_TENSOR = "language_model.model.mtp.layers.0.enorm.weight"


@dataclasses.dataclass(frozen=True)
class FixtureSpec:
  """Static description of one fixture."""

  name: str
  text: dict[str, Any]
  batch: int
  seq_len: int
  gen_prompt_lens: tuple[int, ...]
  base_seed: int
  legacy_config: bool


def _layer_types(kinds: str) -> list[str]:
  """Maps a string such as 'fssf' to HF attention layer types (f=full, s=sparse)."""
  return ["minimax_m3_sparse" if c == "s" else "full_attention" for c in kinds]


def _mlp_types(kinds: str) -> list[str]:
  """Maps a string such as 'dsds' to HF MLP layer types (d=dense, s=sparse MoE)."""
  return ["sparse" if c == "s" else "dense" for c in kinds]


FIXTURES: dict[str, FixtureSpec] = {
  "legacy_b128": FixtureSpec(
    name="legacy_b128",
    text=dict(
      hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
      rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}, rotary_dim=16,
      index_n_heads=2, index_head_dim=32, index_block_size=128, index_topk_blocks=2, index_local_blocks=1,
      num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
      dense_intermediate_size=96, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
      layer_types=_layer_types("fssf"), mlp_layer_types=_mlp_types("dsds"),
    ),
    batch=2, seq_len=600, gen_prompt_lens=(300, 257), base_seed=1234, legacy_config=True,
  ),
  "flat_local2_b128": FixtureSpec(
    name="flat_local2_b128",
    text=dict(
      hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
      rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}, rotary_dim=16,
      index_n_heads=2, index_head_dim=32, index_block_size=128, index_topk_blocks=3, index_local_blocks=2,
      num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
      dense_intermediate_size=96, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
      layer_types=_layer_types("sss"), mlp_layer_types=_mlp_types("ssd"),
    ),
    batch=2, seq_len=700, gen_prompt_lens=(520, 385), base_seed=2345, legacy_config=False,
  ),
  "flat_b16": FixtureSpec(
    name="flat_b16",
    text=dict(
      hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}, rotary_dim=8,
      index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=4, index_local_blocks=1,
      num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32,
      dense_intermediate_size=96, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
      layer_types=_layer_types("ss"), mlp_layer_types=_mlp_types("ss"),
    ),
    batch=2, seq_len=150, gen_prompt_lens=(100, 77), base_seed=3456, legacy_config=False,
  ),
}

VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


# ----------------------------------------------------------------------------------------------------------------
# Model construction
# ----------------------------------------------------------------------------------------------------------------


def build_config(spec: FixtureSpec) -> MiniMaxM3VLConfig:
  """Returns the VL config (vocab 256, no in-vocab special tokens, eager attention)."""
  text = dict(spec.text, vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              max_position_embeddings=4096, tie_word_embeddings=False)
  return MiniMaxM3VLConfig(text_config=text, vision_config=dict(VISION), projector_hidden_size=spec.text["hidden_size"],
                           tie_word_embeddings=False)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
  """Re-initialises every parameter/buffer so nothing is zero, one or degenerate."""
  gen = torch.Generator().manual_seed(seed)

  def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

  lm_head = model.get_output_embeddings()
  for name, mod in sorted(model.named_modules(), key=lambda kv: kv[0]):
    if isinstance(mod, hf_m3.MiniMaxM3VLRMSNorm):
      normal_(mod.weight, 0.3)
    elif isinstance(mod, hf_m3.MiniMaxM3VLTopKRouter):
      normal_(mod.weight, 0.1)
      mod.e_score_correction_bias.copy_(torch.rand(mod.e_score_correction_bias.shape, generator=gen) * 0.4 - 0.2)
    elif isinstance(mod, hf_m3.MiniMaxM3VLExperts):
      normal_(mod.gate_up_proj, 0.1)
      normal_(mod.down_proj, 0.1)
    elif isinstance(mod, torch.nn.Embedding):
      normal_(mod.weight, 1.0)
    elif isinstance(mod, torch.nn.Linear):
      normal_(mod.weight, 0.2 if mod is lm_head else (0.05 if "vision" in name or "projector" in name else 0.1))
      if mod.bias is not None:
        normal_(mod.bias, 0.02)
    elif isinstance(mod, torch.nn.Conv3d):
      normal_(mod.weight, 0.05)
    elif isinstance(mod, torch.nn.LayerNorm):
      normal_(mod.weight, 0.1, mean=1.0)
      normal_(mod.bias, 0.05)
  assert not torch.equal(lm_head.weight, model.get_input_embeddings().weight)


def build_model(spec: FixtureSpec, seed: int) -> MiniMaxM3SparseForConditionalGeneration:
  """Builds the randomised fp32 eager VL model."""
  torch.manual_seed(seed)
  model = MiniMaxM3SparseForConditionalGeneration._from_config(
    build_config(spec), dtype=torch.float32, attn_implementation="eager")
  randomize_(model, seed)
  return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# Probes on the discrete decisions (indexer block top-k, router expert top-k)
# ----------------------------------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """Partial NeoX (half-split) RoPE on the first cos.shape[-1] channels; x [B, H, S, D], cos [B, S, R]."""
  r = cos.shape[-1]
  cos, sin = cos[:, None], sin[:, None]
  xr, xp = x[..., :r], x[..., r:]
  x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
  return torch.cat([xr * cos + torch.cat([-x2, x1], dim=-1) * sin, xp], dim=-1)


class IndexerProbe:
  """Forward hooks on every MiniMaxM3VLIndexer.

  Independently recomputes the block scores (float64), checks that HF selected exactly the expected block set
  (forced local blocks plus the top-scoring rest) and records, per layer, the number of pruned query rows and the
  minimum relative top-k gap.
  """

  def __init__(self, model: torch.nn.Module):
    self.handles = []
    self.stats: dict[int, dict[str, Any]] = {}
    for mod in model.modules():
      if isinstance(mod, hf_m3.MiniMaxM3VLIndexer):
        self.handles.append(mod.register_forward_hook(self._hook))

  def reset(self) -> None:
    """Clears the accumulated statistics."""
    self.stats = {}

  def remove(self) -> None:
    """Removes the hooks."""
    for h in self.handles:
      h.remove()

  @torch.no_grad()
  def _hook(self, mod: hf_m3.MiniMaxM3VLIndexer, args: tuple, out: torch.Tensor) -> None:
    hs, (cos, sin), cache, pos = args
    bsz, q_len, _ = hs.shape
    di = mod.head_dim
    iq = mod.q_norm(mod.q_proj(hs).view(bsz, q_len, -1, di)).transpose(1, 2)
    if cache is not None:
      ik = cache.layers[mod.layer_idx].idx_keys
    else:
      ik = mod.k_norm(mod.k_proj(hs).view(bsz, q_len, 1, di)).transpose(1, 2)
      ik = _rope(ik, cos[..., :di], sin[..., :di])
    iq = _rope(iq, cos[..., :di], sin[..., :di])
    k_len = ik.shape[2]
    bs, topk, local = mod.block_size, mod.topk_blocks, mod.local_blocks
    nblk = -(-k_len // bs)
    scores = torch.matmul(iq.double(), ik.double().transpose(-1, -2))  # [B, Hi, Sq, Sk]
    future = torch.arange(k_len)[None, None, None, :] > pos[:, None, :, None]
    scores = F.pad(scores.masked_fill(future, -math.inf), (0, nblk * bs - k_len), value=-math.inf)
    blk = scores.view(bsz, scores.shape[1], q_len, nblk, bs).amax(-1).numpy()
    sel = out.numpy()
    st = self.stats.setdefault(mod.layer_idx, dict(rows=0, pruned_rows=0, min_rel_gap=math.inf, min_abs_gap=math.inf,
                                                   local_clamped_rows=0, fp32_vs_fp64_flips=0))
    pos_np = pos.numpy()
    for b in range(bsz):
      for q in range(q_len):
        qb = int(pos_np[b, q]) // bs
        nb = qb + 1
        forced = sorted({max(qb - i, 0) for i in range(local)})
        st["rows"] += 1
        if local > 0 and qb - (local - 1) < 0:
          st["local_clamped_rows"] += 1
        if nb > topk:
          st["pruned_rows"] += 1
        for h in range(blk.shape[1]):
          row = blk[b, h, q]
          assert np.all(np.isfinite(row[:nb])) and np.all(np.isneginf(row[nb:])), "valid-block mask mismatch"
          cand = [j for j in range(nb) if j not in forced]
          free = max(topk - len(forced), 0)
          order = sorted(cand, key=lambda j: -row[j])
          expect = set(range(nb)) if nb <= topk else set(forced) | set(order[:free])
          got = [int(x) for x in sel[b, h, q] if x >= 0]
          assert len(got) == len(set(got)) and set(forced) <= set(got), (mod.layer_idx, b, h, q, got, forced)
          rel = math.inf
          if nb > topk and 0 < free < len(cand):
            gap = float(row[order[free - 1]] - row[order[free]])
            rel = gap / max(float(np.max(np.abs(row[cand]))), 1e-30)
            st["min_abs_gap"] = min(st["min_abs_gap"], gap)
            st["min_rel_gap"] = min(st["min_rel_gap"], rel)
          if set(got) != expect:
            # Only a float64-vs-fp32 near-tie may flip a selection; anything else is a real disagreement.
            assert rel < 1e-5, (mod.layer_idx, b, h, q, got, expect, rel)
            st["fp32_vs_fp64_flips"] += 1


class RouterProbe:
  """Forward hooks on every MiniMaxM3VLTopKRouter: expert usage counts and the min K-th vs (K+1)-th gap."""

  def __init__(self, model: torch.nn.Module):
    self.handles = []
    self.names: dict[int, int] = {}
    self.stats: dict[int, dict[str, Any]] = {}
    for name, mod in model.named_modules():
      if isinstance(mod, hf_m3.MiniMaxM3VLTopKRouter):
        self.names[id(mod)] = int(name.split(".layers.")[1].split(".")[0])
        self.handles.append(mod.register_forward_hook(self._hook))

  def reset(self) -> None:
    """Clears the accumulated statistics."""
    self.stats = {}

  def remove(self) -> None:
    """Removes the hooks."""
    for h in self.handles:
      h.remove()

  @torch.no_grad()
  def _hook(self, mod: hf_m3.MiniMaxM3VLTopKRouter, args: tuple, out: tuple) -> None:
    hs = args[0].reshape(-1, mod.hidden_dim)
    choice = torch.sigmoid(F.linear(hs, mod.weight).double()) + mod.e_score_correction_bias.double()
    srt = choice.sort(dim=-1, descending=True).values
    gap = float((srt[:, mod.top_k - 1] - srt[:, mod.top_k]).min())
    idx = out[2]
    expect = choice.topk(mod.top_k, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expect.sort(-1).values), "router selection mismatch"
    layer = self.names[id(mod)]
    st = self.stats.setdefault(layer, dict(min_gap=math.inf, expert_counts=[0] * mod.num_experts))
    st["min_gap"] = min(st["min_gap"], gap)
    for e, c in enumerate(torch.bincount(idx.reshape(-1), minlength=mod.num_experts).tolist()):
      st["expert_counts"][e] += c


# ----------------------------------------------------------------------------------------------------------------
# Reference computations
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(spec: FixtureSpec, cfg: MiniMaxM3VLConfig, seed: int) -> torch.Tensor:
  """Random input ids in [0, vocab) that avoid the image/video placeholder ids."""
  gen = torch.Generator().manual_seed(seed + 7)
  vocab = cfg.text_config.vocab_size
  ids = torch.randint(0, vocab, (spec.batch, spec.seq_len), generator=gen)
  for special in (cfg.image_token_index, cfg.video_token_index):
    ids = torch.where(ids == special, (ids + 1) % vocab, ids)
  return ids


@torch.no_grad()
def forward_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
  """Text-only full forward without cache; returns fp32 logits [B, S, V]."""
  return model(input_ids=ids, use_cache=False).logits.float()


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt: torch.Tensor) -> dict[str, Any]:
  """HF greedy generate (eos disabled) for one prompt [1, P]; returns new tokens plus diagnostics."""
  gc = GenerationConfig(max_new_tokens=GEN_NEW_TOKENS, min_new_tokens=GEN_NEW_TOKENS, do_sample=False,
                        eos_token_id=None, pad_token_id=0, bos_token_id=None, use_cache=True,
                        return_dict_in_generate=True, output_logits=True)
  # An explicit all-ones mask: otherwise HF infers padding from `pad_token_id` occurrences inside the prompt.
  out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
  seq = out.sequences
  new = seq[0, prompt.shape[1]:]
  assert new.shape[0] == GEN_NEW_TOKENS
  step_logits = torch.stack([lg[0].float() for lg in out.logits])  # [48, V]
  top2 = step_logits.topk(2, dim=-1).values
  cache = out.past_key_values
  return dict(tokens=new, seq=seq, step_logits=step_logits,
              min_margin=float((top2[:, 0] - top2[:, 1]).min()),
              cache_layer_types=[type(layer).__name__ for layer in cache.layers])


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint writing and verification
# ----------------------------------------------------------------------------------------------------------------


def expected_text_tensors(tc: Any) -> dict[str, tuple[int, ...]]:
  """Original-layout text tensor names and shapes (spec section 5.1) for a text config."""
  h, d, v = tc.hidden_size, tc.head_dim, tc.vocab_size
  p = "language_model.model."
  names: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (v, h), p + "norm.weight": (h,),
                                       "language_model.lm_head.weight": (v, h)}
  for i in range(tc.num_hidden_layers):
    lp = f"{p}layers.{i}."
    names.update({lp + "input_layernorm.weight": (h,), lp + "post_attention_layernorm.weight": (h,),
                  lp + "self_attn.q_proj.weight": (tc.num_attention_heads * d, h),
                  lp + "self_attn.k_proj.weight": (tc.num_key_value_heads * d, h),
                  lp + "self_attn.v_proj.weight": (tc.num_key_value_heads * d, h),
                  lp + "self_attn.o_proj.weight": (h, tc.num_attention_heads * d),
                  lp + "self_attn.q_norm.weight": (d,), lp + "self_attn.k_norm.weight": (d,)})
    if tc.layer_types[i] == "minimax_m3_sparse":
      di = tc.index_head_dim
      names.update({lp + "self_attn.index_q_proj.weight": (tc.index_n_heads * di, h),
                    lp + "self_attn.index_k_proj.weight": (di, h),
                    lp + "self_attn.index_q_norm.weight": (di,), lp + "self_attn.index_k_norm.weight": (di,)})
    if tc.mlp_layer_types[i] == "sparse":
      mp = lp + "block_sparse_moe."
      e, it, s = tc.num_local_experts, tc.intermediate_size, tc.shared_intermediate_size
      names.update({mp + "gate.weight": (e, h), mp + "e_score_correction_bias": (e,),
                    mp + "shared_experts.gate_proj.weight": (s, h), mp + "shared_experts.up_proj.weight": (s, h),
                    mp + "shared_experts.down_proj.weight": (h, s)})
      for j in range(e):
        names.update({f"{mp}experts.{j}.w1.weight": (it, h), f"{mp}experts.{j}.w3.weight": (it, h),
                      f"{mp}experts.{j}.w2.weight": (h, it)})
    else:
      it = tc.dense_intermediate_size
      names.update({lp + "mlp.gate_proj.weight": (it, h), lp + "mlp.up_proj.weight": (it, h),
                    lp + "mlp.down_proj.weight": (h, it)})
  return names


def read_checkpoint(ckpt: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
  """Returns (index json, {tensor name: shape}) for a sharded checkpoint, checking index/shard consistency."""
  with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
    index = json.load(f)
  shapes: dict[str, tuple[int, ...]] = {}
  total = 0
  for shard in sorted(set(index["weight_map"].values())):
    with safe_open(os.path.join(ckpt, shard), "pt") as f:
      for k in f.keys():
        assert index["weight_map"].get(k) == shard, f"{k} not indexed to {shard}"
        sl = f.get_slice(k)
        shapes[k] = tuple(sl.get_shape())
        total += int(np.prod(shapes[k], dtype=np.int64)) * 4
  assert set(shapes) == set(index["weight_map"]), "index lists tensors missing from shards"
  assert index["metadata"]["total_size"] == total, (index["metadata"], total)
  return index, shapes


def verify_layout(ckpt: str, model: MiniMaxM3SparseForConditionalGeneration) -> dict[str, Any]:
  """Checks the saved names/shapes against the original MiniMax layout and the expert/MLP packing."""
  tc = model.config.text_config
  index, shapes = read_checkpoint(ckpt)
  expect = expected_text_tensors(tc)
  text = {k: s for k, s in shapes.items() if k.startswith("language_model.") and ".mtp." not in k}
  assert set(text) == set(expect), (sorted(set(text) ^ set(expect)))[:20]
  for k, s in expect.items():
    assert text[k] == s, (k, text[k], s)
  other = sorted(k for k in shapes if not k.startswith("language_model."))
  prefixes = ("vision_tower.vision_model.", "multi_modal_projector.", "patch_merge_mlp.")
  assert other and all(k.startswith(prefixes) for k in other), other
  assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in shapes
  assert "vision_tower.vision_model.pre_layrnorm.weight" in shapes
  # Packing: HF [gate; up] concatenation must split into w1 (gate) / w3 (up); w2 is down, no transposes.
  sd = {}
  for shard in sorted(set(index["weight_map"].values())):
    sd.update(load_file(os.path.join(ckpt, shard)))
  lm = model.model.language_model
  for i, layer in enumerate(lm.layers):
    p = f"language_model.model.layers.{i}."
    if tc.mlp_layer_types[i] == "sparse":
      it, s = tc.intermediate_size, tc.shared_intermediate_size
      ex = layer.mlp.experts
      for e in range(tc.num_local_experts):
        assert torch.equal(sd[f"{p}block_sparse_moe.experts.{e}.w1.weight"], ex.gate_up_proj[e, :it])
        assert torch.equal(sd[f"{p}block_sparse_moe.experts.{e}.w3.weight"], ex.gate_up_proj[e, it:])
        assert torch.equal(sd[f"{p}block_sparse_moe.experts.{e}.w2.weight"], ex.down_proj[e])
      sh = layer.mlp.shared_experts
      assert torch.equal(sd[f"{p}block_sparse_moe.shared_experts.gate_proj.weight"], sh.gate_up_proj.weight[:s])
      assert torch.equal(sd[f"{p}block_sparse_moe.shared_experts.up_proj.weight"], sh.gate_up_proj.weight[s:])
      assert torch.equal(sd[f"{p}block_sparse_moe.e_score_correction_bias"], layer.mlp.gate.e_score_correction_bias)
    else:
      it = tc.dense_intermediate_size
      assert torch.equal(sd[f"{p}mlp.gate_proj.weight"], layer.mlp.gate_up_proj.weight[:it])
      assert torch.equal(sd[f"{p}mlp.up_proj.weight"], layer.mlp.gate_up_proj.weight[it:])
    if tc.layer_types[i] == "minimax_m3_sparse":
      assert torch.equal(sd[f"{p}self_attn.index_q_proj.weight"], layer.self_attn.indexer.q_proj.weight)
  assert torch.equal(sd["language_model.lm_head.weight"], model.lm_head.weight)
  return dict(num_tensors=len(shapes), num_text_tensors=len(text), num_vision_mm_tensors=len(other),
              num_shards=len(set(index["weight_map"].values())), layout="original MiniMax (raw checkpoint)")


def add_mtp_tensor(ckpt: str, hidden: int, seed: int) -> None:
  """Appends a fake mtp enorm weight [H] to the last shard and to the index (loaders must skip it)."""
  path = os.path.join(ckpt, "model.safetensors.index.json")
  with open(path) as f:
    index = json.load(f)
  shard = sorted(set(index["weight_map"].values()))[-1]
  tensors = load_file(os.path.join(ckpt, shard))
  gen = torch.Generator().manual_seed(seed + 99)
  tensors[MTP_TENSOR] = torch.randn(hidden, generator=gen) * 0.3
  save_file(tensors, os.path.join(ckpt, shard), metadata={"format": "pt"})
  index["weight_map"][MTP_TENSOR] = shard
  index["weight_map"] = dict(sorted(index["weight_map"].items()))
  index["metadata"]["total_size"] += hidden * 4
  with open(path, "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
    f.write("\n")


def legacy_text_config(tc: dict[str, Any]) -> dict[str, Any]:
  """Rewrites an HF-flat text_config dict into the released/legacy MiniMax spelling."""
  out = {k: v for k, v in tc.items()
         if k not in ("layer_types", "mlp_layer_types", "rope_parameters") and not k.startswith("index_")}
  sparse = [1 if t == "minimax_m3_sparse" else 0 for t in tc["layer_types"]]
  out["sparse_attention_config"] = dict(
    sparse_attention_freq=sparse, sparse_num_index_heads=tc["index_n_heads"], sparse_index_dim=tc["index_head_dim"],
    sparse_block_size=tc["index_block_size"], sparse_topk_blocks=tc["index_topk_blocks"],
    sparse_local_block=tc["index_local_blocks"], sparse_init_block=0, sparse_score_type="max",
    sparse_disable_index_value=list(sparse))
  out["moe_layer_freq"] = [1 if t == "sparse" else 0 for t in tc["mlp_layer_types"]]
  rp = tc["rope_parameters"]
  out.update(rope_theta=rp["rope_theta"], partial_rotary_factor=rp["partial_rotary_factor"],
             rotary_dim=int(tc["head_dim"] * rp["partial_rotary_factor"]), hidden_act="swigluoai",
             n_shared_experts=1, scoring_func="sigmoid", use_routing_bias=True, use_gemma_norm=True,
             qk_norm_type="per_head", use_qk_norm=True, attention_output_gate=False, num_mtp_modules=1)
  return dict(sorted(out.items()))


def rewrite_config_legacy(ckpt: str) -> None:
  """Rewrites config.json's text_config into the legacy spelling in place."""
  path = os.path.join(ckpt, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg["text_config"] = legacy_text_config(cfg["text_config"])
  with open(path, "w") as f:
    json.dump(cfg, f, indent=2, sort_keys=True)
    f.write("\n")


def parsed_text_summary(tc: Any) -> dict[str, Any]:
  """The HF-parsed text config fields that matter for the math."""
  keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "shared_intermediate_size", "dense_intermediate_size", "num_local_experts",
          "num_experts_per_tok", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "rms_norm_eps",
          "rope_parameters", "rotary_dim", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
          "index_local_blocks", "layer_types", "mlp_layer_types", "tie_word_embeddings"]
  return {k: getattr(tc, k) for k in keys}


@torch.no_grad()
def reload_logits(ckpt: str, ids: torch.Tensor) -> tuple[torch.Tensor, MiniMaxM3SparseForConditionalGeneration]:
  """Reloads a checkpoint directory with HF and runs the text-only forward."""
  model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
    ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
  assert not info["missing_keys"], info["missing_keys"]
  assert not info["mismatched_keys"], info["mismatched_keys"]
  unexpected = set(info["unexpected_keys"])
  assert all(".mtp." in k for k in unexpected), unexpected
  return forward_logits(model.eval(), ids), model


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
  """JSON-friendly float (None for inf)."""
  return None if not math.isfinite(x) else float(x)


def evaluate_seed(spec: FixtureSpec, seed: int) -> tuple[bool, dict[str, Any]]:
  """Builds the model for one seed and runs every reference computation plus robustness probes."""
  model = build_model(spec, seed)
  cfg = model.config
  tc = cfg.text_config
  ids = make_inputs(spec, cfg, seed)
  iprobe, rprobe = IndexerProbe(model), RouterProbe(model)
  logits = forward_logits(model, ids)
  fwd_index = {k: dict(v) for k, v in sorted(iprobe.stats.items())}
  fwd_router = {k: dict(v) for k, v in sorted(rprobe.stats.items())}
  fwd_gap = min(v["min_rel_gap"] for v in fwd_index.values())
  router_gap = min(v["min_gap"] for v in fwd_router.values())
  if fwd_gap < MIN_INDEX_REL_GAP or router_gap < MIN_ROUTER_GAP:  # cheap early reject before generating
    iprobe.remove()
    rprobe.remove()
    return False, dict(fwd_gap=fwd_gap, gen_gap=math.nan, router_gap=router_gap, margin=math.nan,
                       reasons=[f"forward indexer rel gap {fwd_gap:.2e} / router gap {router_gap:.2e}"])
  gens = []
  gen_index: dict[int, dict[str, Any]] = {}
  for b, plen in enumerate(spec.gen_prompt_lens):
    iprobe.reset()
    g = greedy_generate(model, ids[b:b + 1, :plen])
    for k, v in iprobe.stats.items():
      agg = gen_index.setdefault(k, dict(rows=0, pruned_rows=0, min_rel_gap=math.inf, min_abs_gap=math.inf,
                                         local_clamped_rows=0, fp32_vs_fp64_flips=0))
      for key in ("rows", "pruned_rows", "local_clamped_rows", "fp32_vs_fp64_flips"):
        agg[key] += v[key]
      for key in ("min_rel_gap", "min_abs_gap"):
        agg[key] = min(agg[key], v[key])
    # Teacher-forced check: the full no-cache forward over prompt + generated tokens reproduces every greedy step.
    tf = forward_logits(model, g["seq"][:, :-1])[0, plen - 1:]
    g["teacher_forced_argmax_equal"] = bool(torch.equal(tf.argmax(-1), g["tokens"]))
    g["max_abs_diff_cached_vs_full"] = float((tf - g["step_logits"]).abs().max())
    gens.append(g)
  iprobe.remove()
  rprobe.remove()
  sparse_layers = [i for i, t in enumerate(tc.layer_types) if t == "minimax_m3_sparse"]
  gen_gap = min(v["min_rel_gap"] for v in gen_index.values())
  margin = min(g["min_margin"] for g in gens)
  experts_used = {k: sum(c > 0 for c in v["expert_counts"]) for k, v in fwd_router.items()}
  reasons = []
  if sorted(fwd_index) != sparse_layers or any(fwd_index[i]["pruned_rows"] == 0 for i in sparse_layers):
    reasons.append("a sparse layer pruned nothing")
  if any(gen_index.get(i, {}).get("pruned_rows", 0) == 0 for i in sparse_layers):
    reasons.append("a sparse layer pruned nothing during generation")
  if fwd_gap < MIN_INDEX_REL_GAP:
    reasons.append(f"forward indexer rel gap {fwd_gap:.2e}")
  if gen_gap < MIN_INDEX_REL_GAP:
    reasons.append(f"generate indexer rel gap {gen_gap:.2e}")
  if router_gap < MIN_ROUTER_GAP:
    reasons.append(f"router gap {router_gap:.2e}")
  if margin < MIN_ARGMAX_MARGIN:
    reasons.append(f"greedy margin {margin:.2e}")
  if any(n < max(2, tc.num_local_experts - 1) for n in experts_used.values()):
    reasons.append(f"router too concentrated {experts_used}")
  distinct = [len(set(g["tokens"].tolist())) for g in gens]
  if min(distinct) < MIN_DISTINCT_GEN:
    reasons.append(f"degenerate greedy continuation ({distinct} distinct tokens)")
  if not all(g["teacher_forced_argmax_equal"] for g in gens):
    reasons.append("cached generate disagrees with teacher-forced full forward")
  result = dict(model=model, ids=ids, logits=logits, gens=gens, fwd_index=fwd_index, gen_index=gen_index,
                fwd_router=fwd_router, fwd_gap=fwd_gap, gen_gap=gen_gap, router_gap=router_gap, margin=margin,
                reasons=reasons)
  return not reasons, result


def _sha256(path: str) -> str:
  """Hex sha256 of a file."""
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def make_fixture(spec: FixtureSpec, out_dir: str, max_tries: int) -> dict[str, Any]:
  """Builds, verifies and writes one fixture; returns its meta dict."""
  rejected = []
  for attempt in range(max_tries):
    seed = spec.base_seed + attempt
    ok, res = evaluate_seed(spec, seed)
    print(f"[{spec.name}] seed {seed}: fwd_gap={res['fwd_gap']:.3e} gen_gap={res['gen_gap']:.3e} "
          f"router_gap={res['router_gap']:.3e} margin={res['margin']:.3e} {'OK' if ok else res['reasons']}", flush=True)
    if ok:
      break
    rejected.append(dict(seed=seed, reasons=res["reasons"]))
  else:
    raise RuntimeError(f"{spec.name}: no acceptable seed in {max_tries} tries")

  model, ids, logits = res["model"], res["ids"], res["logits"]
  tc = model.config.text_config
  fdir = os.path.join(out_dir, spec.name)
  ckpt = os.path.join(fdir, "checkpoint")
  shutil.rmtree(fdir, ignore_errors=True)
  os.makedirs(fdir)
  model.save_pretrained(ckpt, max_shard_size="300KB", safe_serialization=True)
  gen_cfg = os.path.join(ckpt, "generation_config.json")
  if os.path.exists(gen_cfg):
    with open(gen_cfg) as f:
      useful = {k: v for k, v in json.load(f).items()
                if k not in ("_from_model_config", "transformers_version", "use_cache", "output_attentions",
                             "output_hidden_states") and v is not None}
    if not useful:
      os.remove(gen_cfg)
  layout = verify_layout(ckpt, model)
  add_mtp_tensor(ckpt, tc.hidden_size, seed)
  read_checkpoint(ckpt)  # index/shard consistency after the mtp edit

  reloaded, _ = reload_logits(ckpt, ids)
  reload_equal = bool(torch.equal(reloaded, logits))
  assert reload_equal, f"reloaded logits differ by {float((reloaded - logits).abs().max())}"
  legacy = None
  if spec.legacy_config:
    flat_summary = parsed_text_summary(tc)
    rewrite_config_legacy(ckpt)
    parsed = MiniMaxM3VLConfig.from_pretrained(ckpt).text_config
    legacy_summary = parsed_text_summary(parsed)
    diff = {k: (flat_summary[k], legacy_summary[k]) for k in flat_summary if flat_summary[k] != legacy_summary[k]}
    leg_logits, leg_model = reload_logits(ckpt, ids)
    legacy = dict(parsed_fields_differing_from_flat={k: [str(a), str(b)] for k, (a, b) in diff.items()},
                  logits_bitwise_equal=bool(torch.equal(leg_logits, logits)),
                  hf_hidden_act_after_parse=parsed.hidden_act,
                  raw_keys_kept_as_attributes=sorted(k for k in ("sparse_attention_config", "moe_layer_freq",
                                                                 "n_shared_experts", "scoring_func", "use_gemma_norm",
                                                                 "num_mtp_modules", "use_routing_bias")
                                                     if hasattr(parsed, k)))
    assert not diff, diff
    assert legacy["logits_bitwise_equal"]

  gen_tokens = torch.stack([g["tokens"] for g in res["gens"]]).to(torch.int32)
  np.savez_compressed(os.path.join(fdir, "reference.npz"),
                      input_ids=ids.to(torch.int32).numpy(),
                      logits=logits.numpy().astype(np.float32),
                      gen_prompt_lens=np.asarray(spec.gen_prompt_lens, np.int32),
                      gen_tokens=gen_tokens.numpy())

  def layer_stats(d: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {str(k): {kk: (_finite(vv) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in d.items()}

  meta = dict(
    name=spec.name, seed=seed, rejected_seeds=rejected, batch=spec.batch, seq_len=spec.seq_len,
    versions=dict(transformers=transformers.__version__, torch=torch.__version__, numpy=np.__version__,
                  python=sys.version.split()[0]),
    hf_class="MiniMaxM3SparseForConditionalGeneration", dtype="float32", attn_implementation="eager",
    config_spelling="legacy (sparse_attention_config / moe_layer_freq / top-level rope)" if spec.legacy_config
    else "hf flat (layer_types / mlp_layer_types / index_* / rope_parameters)",
    text_config=parsed_text_summary(tc),
    vision_config=dict(VISION), image_token_index=model.config.image_token_index,
    video_token_index=model.config.video_token_index,
    checkpoint=dict(layout, mtp_tensor_added=MTP_TENSOR, reload_logits_bitwise_equal=reload_equal,
                    legacy_config=legacy),
    robustness=dict(
      score_scale="per (layer, batch, index head, query) row: max |block score| over its valid non-forced blocks",
      forward_min_rel_topk_gap=res["fwd_gap"], generate_min_rel_topk_gap=res["gen_gap"],
      forward_min_router_gap=res["router_gap"], generate_min_argmax_margin=res["margin"],
      thresholds=dict(index_rel_gap=MIN_INDEX_REL_GAP, router_gap=MIN_ROUTER_GAP, argmax_margin=MIN_ARGMAX_MARGIN,
                      min_distinct_generated_tokens=MIN_DISTINCT_GEN)),
    indexer_forward=layer_stats(res["fwd_index"]),
    indexer_generate=layer_stats(res["gen_index"]),
    pruned_query_positions_forward={str(k): v["pruned_rows"] for k, v in res["fwd_index"].items()},
    pruned_query_positions_generate={str(k): v["pruned_rows"] for k, v in res["gen_index"].items()},
    router_forward=layer_stats(res["fwd_router"]),
    generation=dict(max_new_tokens=GEN_NEW_TOKENS, do_sample=False, eos_token_id=None,
                    prompt_lens=list(spec.gen_prompt_lens), prompts="input_ids[b, :gen_prompt_lens[b]], batch 1 each",
                    teacher_forced_argmax_equal=[g["teacher_forced_argmax_equal"] for g in res["gens"]],
                    max_abs_diff_cached_step_logits_vs_full_forward=[g["max_abs_diff_cached_vs_full"]
                                                                     for g in res["gens"]],
                    min_argmax_margin=[g["min_margin"] for g in res["gens"]],
                    distinct_generated_tokens=[len(set(g["tokens"].tolist())) for g in res["gens"]],
                    hf_cache_layer_types=res["gens"][0]["cache_layer_types"]),
    logits_stats=dict(mean=float(logits.mean()), std=float(logits.std()), absmax=float(logits.abs().max())),
    files={os.path.relpath(os.path.join(r, f), fdir): _sha256(os.path.join(r, f))
           for r, _, fs in os.walk(fdir) for f in sorted(fs)},
  )
  with open(os.path.join(fdir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
    f.write("\n")
  return meta


# ----------------------------------------------------------------------------------------------------------------
# Training references (--gradients)
# ----------------------------------------------------------------------------------------------------------------

# Parameters whose gradients are recorded (HF in-memory names; {L} = the last MoE layer, {S} = the last sparse one).
GRAD_PARAMS = ("model.language_model.embed_tokens.weight", "lm_head.weight",
               "model.language_model.layers.{L}.mlp.experts.gate_up_proj",
               "model.language_model.layers.{L}.mlp.experts.down_proj",
               "model.language_model.layers.{L}.mlp.gate.weight",
               "model.language_model.layers.{S}.self_attn.indexer.q_proj.weight",
               "model.language_model.layers.{S}.self_attn.indexer.k_proj.weight")


def alignment_loss_torch(attn: torch.nn.Module, x: torch.Tensor, position_embeddings, positions: torch.Tensor,
                         selected: torch.Tensor | None) -> torch.Tensor:
  """m3jax.training's indexer alignment loss for one sparse layer, restated on HF's modules.

  x: the layer's normed attention input [B, S, H]. Target: the dense causal attention of the layer's q / k
  (detached), summed per key block and over each KV group's heads / their count. Prediction: log-softmax of the
  indexer's block-max scores over the candidate blocks (visible ones; with ``selected`` [B, G, S, T] (HF's block
  indices) only the selected ones), computed from the detached input so that only the indexer gets gradients.
  KL(target || prediction) averaged over the (batch, group, query) rows with at least two candidate blocks.
  """
  x = x.detach()
  b, s, _ = x.shape
  cos, sin = position_embeddings
  with torch.no_grad():
    q = attn.q_norm(attn.q_proj(x).view(b, s, -1, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, s, -1, attn.head_dim)).transpose(1, 2)
    q, k = hf_m3.apply_rotary_pos_emb(q, k, cos, sin)
    nq, nkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(nq // nkv, dim=1)
    logits = torch.matmul(q, kk.transpose(-1, -2)) * attn.scaling
    future = torch.arange(s)[None, None, None, :] > positions[:, None, :, None]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)  # [B, Nq, S, S]
  idx = attn.indexer
  bs = idx.block_size
  nb = -(-s // bs)
  pad = nb * bs - s
  with torch.no_grad():
    mass = F.pad(probs, (0, pad)).view(b, nkv, nq // nkv, s, nb, bs).sum(dim=(2, 5)) / (nq // nkv)  # [B,G,S,nb]
  iq = idx.q_norm(idx.q_proj(x).view(b, s, -1, idx.head_dim)).transpose(1, 2)
  ik = idx.k_norm(idx.k_proj(x).view(b, s, 1, idx.head_dim)).transpose(1, 2)
  iq, ik = hf_m3.apply_rotary_pos_emb(iq, ik, cos[..., :idx.head_dim], sin[..., :idx.head_dim])
  scores = torch.matmul(iq.float(), ik.float().transpose(-1, -2)).masked_fill(future, float("-inf"))
  scores = F.pad(scores, (0, pad), value=float("-inf")).view(b, -1, s, nb, bs).amax(dim=-1)  # [B, G, S, nb]
  cand = torch.isfinite(scores)
  if selected is not None:
    hit = torch.zeros_like(cand)
    for t in range(selected.shape[-1]):
      ids = selected[..., t]
      hit |= (torch.arange(nb)[None, None, None, :] == ids[..., None]) & (ids[..., None] >= 0)
    cand &= hit
  p = torch.where(cand, mass, torch.zeros_like(mass))
  p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
  log_q = torch.log_softmax(scores.masked_fill(~cand, float("-inf")), dim=-1)
  safe_p = torch.where(p > 0, p, torch.ones_like(p))
  terms = torch.where(p > 0, p * (torch.log(safe_p) - torch.where(cand, log_q, torch.zeros_like(log_q))),
                      torch.zeros_like(p))
  rows = (cand.sum(-1) >= 2).float()
  return (terms.sum(-1) * rows).sum() / rows.sum().clamp_min(1.0)


def make_gradients(name: str, out_dir: str) -> dict[str, Any]:
  """Writes <out_dir>/<name>/gradients.npz from the committed fixture checkpoint and reference inputs."""
  fdir = os.path.join(out_dir, name)
  ids = torch.from_numpy(np.load(os.path.join(fdir, "reference.npz"))["input_ids"]).long()
  model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
    os.path.join(fdir, "checkpoint"), dtype=torch.float32, attn_implementation="eager")
  model.train()  # dropout is 0 in these configs; train() only enables autograd-friendly paths
  tc = model.config.text_config
  moe_layer = max(i for i, t in enumerate(tc.mlp_layer_types) if t == "sparse")
  sparse_layers = [i for i, t in enumerate(tc.layer_types) if t == "minimax_m3_sparse"]
  names = [n.format(L=moe_layer, S=sparse_layers[-1]) for n in GRAD_PARAMS]
  params = dict(model.named_parameters())
  out = model(input_ids=ids, labels=ids, use_cache=False)
  model.zero_grad()
  out.loss.backward()
  arrays: dict[str, np.ndarray] = {"loss": np.asarray(out.loss.item(), np.float64)}
  no_grad = []
  for n in names:
    g = params[n].grad
    if g is None:
      no_grad.append(n)
      g = torch.zeros_like(params[n])
    arrays[f"grad/{n}"] = g.detach().numpy().astype(np.float32)

  # Alignment loss per sparse layer: capture each attention's input, HF's block indices and the rope tables.
  captured: dict[int, dict[str, Any]] = {}
  hooks = []
  layers = model.model.language_model.layers
  for i in sparse_layers:
    attn = layers[i].self_attn

    def pre(mod, args, kwargs, i=i):
      captured.setdefault(i, {})["x"] = kwargs["hidden_states"]
      captured[i]["pe"] = kwargs["position_embeddings"]

    def sel(mod, args, result, i=i):
      captured.setdefault(i, {})["selected"] = result

    hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
    hooks.append(attn.indexer.register_forward_hook(sel))
  with torch.no_grad():
    model(input_ids=ids, use_cache=False)
  for h in hooks:
    h.remove()
  positions = torch.arange(ids.shape[1])[None, :].expand(ids.shape[0], -1)
  for i in sparse_layers:
    attn = layers[i].self_attn
    for phase, selected in (("dense", None), ("sparse", captured[i]["selected"])):
      model.zero_grad()
      loss = alignment_loss_torch(attn, captured[i]["x"], captured[i]["pe"], positions, selected)
      loss.backward()
      arrays[f"alignment/{i}/{phase}/loss"] = np.asarray(loss.item(), np.float64)
      for proj in ("q_proj", "k_proj"):
        arrays[f"alignment/{i}/{phase}/grad/{proj}"] = getattr(attn.indexer, proj).weight.grad.numpy().copy()
  arrays["no_grad"] = np.asarray(no_grad, dtype=np.str_)
  arrays["versions"] = np.asarray([f"transformers={transformers.__version__}", f"torch={torch.__version__}"])
  np.savez_compressed(os.path.join(fdir, "gradients.npz"), **arrays)
  return {"name": name, "loss": out.loss.item(), "no_grad": no_grad,
          "alignment": {k: float(v) for k, v in arrays.items() if k.startswith("alignment/") and k.endswith("loss")}}


def main() -> None:
  """CLI entry point."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out-dir", default="tests/fixtures", help="where <name>/ fixture folders are written")
  ap.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="build only these fixtures")
  ap.add_argument("--max-seed-tries", type=int, default=20, help="seeds tried per fixture before giving up")
  ap.add_argument("--gradients", nargs="+", choices=sorted(FIXTURES), default=None,
                  help="instead of building fixtures, write gradients.npz for these committed ones")
  args = ap.parse_args()
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  if args.gradients:
    for name in args.gradients:
      print(json.dumps(make_gradients(name, args.out_dir)))
    return
  os.makedirs(args.out_dir, exist_ok=True)
  for name in args.only or list(FIXTURES):
    meta = make_fixture(FIXTURES[name], args.out_dir, args.max_seed_tries)
    print(json.dumps(dict(name=name, seed=meta["seed"], robustness=meta["robustness"],
                          pruned=meta["pruned_query_positions_forward"]), indent=None))


if __name__ == "__main__":
  main()
