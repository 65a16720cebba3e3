"""Build the MXFP8 and FP8-block (128 x 128) golden fixtures of the MiniMax M3 text model with HF transformers.

For every fixture this script

1. builds a tiny random ``MiniMaxM3SparseForConditionalGeneration`` in fp32 / eager with one of the text configs
   of scripts/make_hf_fixtures.py (same randomisation), and saves it in the original MiniMax layout;
2. quantizes every linear weight of the text layers (attention q/k/v/o, indexer q/k, dense MLP, shared expert,
   routed experts w1/w2/w3) with m3jax's reference quantizers (m3jax/checkpoint/quantized.py, loaded from its
   file: it needs only numpy + ml_dtypes), and writes the quantized checkpoint (F8_E4M3 ``weight`` +
   ``weight_scale_inv``: U8 E8M0 [out, in/32] for MXFP8, F32 [ceil(out/128), ceil(in/128)] for FP8-block) with a
   ``quantization_config`` whose ``ignored_layers`` name the router gates, LM head and vision modules (which stay
   fp32 / bf16: the vision tower is stored in bf16 to keep the fixture small);
3. loads (a) an fp32 checkpoint holding the exactly dequantized weights and (b) the quantized checkpoint itself
   (HF dequantizes FP8 on a CPU) with ``from_pretrained`` and checks that both give the same logits bit for bit;
4. records HF's fp32 logits at a subset of positions (every 8th, plus every position of the last key blocks,
   where the indexer prunes blocks) and HF's *forward* greedy tokens: each token is the argmax of a full
   no-cache forward over the prompt and the tokens so far (not HF's cached generate);
5. checks every discrete decision for near-ties (indexer top-k blocks, router top-k, greedy argmax margins, as
   make_hf_fixtures.py does) and moves to the next seed if one is close.

Run with the HF reference venv (torch CPU + transformers 5.23.0 + accelerate + ml_dtypes), from the repository
root::

  /work/venvref/bin/python scripts/make_hf_quantized_fixtures.py --out-dir tests/fixtures

This file is a generator only; tests never import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import MiniMaxM3SparseForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_hf_fixtures as base  # noqa: E402  (the tiny configs, randomisation and probes)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_quantizers():
  """m3jax/checkpoint/quantized.py as a module of its own (the m3jax package itself needs jax)."""
  spec = importlib.util.spec_from_file_location("m3jax_quantized", os.path.join(REPO, "m3jax/checkpoint/quantized.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["m3jax_quantized"] = module  # dataclasses resolves annotations through sys.modules
  spec.loader.exec_module(module)
  return module


q = _load_quantizers()
GEN_NEW_TOKENS = 16
IGNORED = ["lm_head", "block_sparse_moe.gate", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]


@dataclasses.dataclass(frozen=True)
class QuantFixture:
  """One fixture: the text config of ``base_fixture``, a format and the inputs."""

  name: str
  base_fixture: str
  fmt: str  # 'mxfp8' | 'fp8_block'
  batch: int
  seq_len: int
  gen_prompt_lens: tuple[int, ...]
  base_seed: int

  @property
  def quantization_config(self) -> dict[str, Any]:
    if self.fmt == "mxfp8":
      return {"quant_method": "mxfp8", "ignored_layers": list(IGNORED)}
    return {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            "ignored_layers": list(IGNORED)}


FIXTURES = {
    "mxfp8_b128": QuantFixture("mxfp8_b128", "legacy_b128", "mxfp8", batch=2, seq_len=320,
                               gen_prompt_lens=(300, 201), base_seed=4567),
    "fp8block_b128": QuantFixture("fp8block_b128", "flat_local2_b128", "fp8_block", batch=2, seq_len=448,
                                  gen_prompt_lens=(430, 260), base_seed=5678),
}


def logit_positions(spec: QuantFixture, block_size: int, topk: int) -> np.ndarray:
  """Every 8th position, plus every position from the first query block whose selection prunes a block."""
  pruning = topk * block_size
  return np.unique(np.concatenate([np.arange(0, spec.seq_len, 8), np.arange(pruning, spec.seq_len)]))


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
  """The text layers' linear weights (not router gates, embeddings, LM head, norms, vision, MTP)."""
  return (t.ndim == 2 and name.endswith(".weight") and name.startswith("language_model.model.layers.")
          and not name.endswith("block_sparse_moe.gate.weight"))


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
  """(quantized checkpoint tensors, the fp32 tensors they represent, number of quantized weights)."""
  quant, deq, n = {}, {}, 0
  for name, t in sorted(tensors.items()):
    if not is_quantized_linear(name, t):
      keep = t.to(torch.bfloat16) if name.startswith(("vision_tower.", "multi_modal_projector.",
                                                       "patch_merge_mlp.")) else t
      quant[name] = keep
      deq[name] = keep
      continue
    w = t.numpy().astype(np.float32)
    if fmt == "mxfp8":
      w8, s = q.quantize_mxfp8(w)
      block = (1, q.MX_BLOCK)
    else:
      w8, s = q.quantize_fp8_block(w, (128, 128))
      block = (128, 128)
    module = name[: -len(".weight")]
    quant[name] = torch.from_numpy(w8.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    quant[module + q.SCALE_INV] = torch.from_numpy(np.ascontiguousarray(s))
    deq[name] = torch.from_numpy(q.dequantize_blocked(w8, s, block))
    n += 1
  return quant, deq, n


@torch.no_grad()
def forward_greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> dict[str, Any]:
  """n tokens, each the argmax of a full no-cache forward over the sequence so far; with the top-2 margins."""
  seq, tokens, margins = prompt, [], []
  for _ in range(n):
    last = base.forward_logits(model, seq)[0, -1]
    top2 = last.topk(2).values
    margins.append(float(top2[0] - top2[1]))
    tok = last.argmax().reshape(1, 1)
    tokens.append(int(tok))
    seq = torch.cat([seq, tok], dim=1)
  return dict(tokens=tokens, min_margin=min(margins))


def write_checkpoint(path: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
  os.makedirs(path)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")


def evaluate_seed(spec: QuantFixture, seed: int, work: str) -> tuple[bool, dict[str, Any]]:
  """Builds the checkpoints of one seed and runs the reference computations plus the robustness probes."""
  hf = base.build_model(base.FIXTURES[spec.base_fixture], seed)
  cfg = hf.config
  tc = cfg.text_config
  saved = os.path.join(work, f"saved_{seed}")
  hf.save_pretrained(saved, safe_serialization=True)
  with open(os.path.join(saved, "config.json")) as f:
    config = json.load(f)
  tensors = {}
  for file in sorted(os.listdir(saved)):
    if file.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(saved, file)))
  quant, deq, n_quantized = quantize_tensors(tensors, spec.fmt)
  qdir, ddir = os.path.join(work, f"quant_{seed}"), os.path.join(work, f"deq_{seed}")
  write_checkpoint(qdir, quant, config | {"quantization_config": spec.quantization_config})
  write_checkpoint(ddir, deq, config)

  model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(ddir, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
  qmodel = MiniMaxM3SparseForConditionalGeneration.from_pretrained(qdir, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
  ids = base.make_inputs(base.FIXTURES[spec.base_fixture], cfg, seed)[:spec.batch, :spec.seq_len]
  iprobe, rprobe = base.IndexerProbe(model), base.RouterProbe(model)
  logits = base.forward_logits(model, ids)
  hf_quant_logits = base.forward_logits(qmodel, ids)
  gens = [forward_greedy(model, ids[b:b + 1, :plen], GEN_NEW_TOKENS) for b, plen in enumerate(spec.gen_prompt_lens)]
  iprobe.remove()
  rprobe.remove()
  index_gap = min(v["min_rel_gap"] for v in iprobe.stats.values())
  router_gap = min(v["min_gap"] for v in rprobe.stats.values())
  margin = min(g["min_margin"] for g in gens)
  sparse_layers = [i for i, t in enumerate(tc.layer_types) if t == "minimax_m3_sparse"]
  reasons = []
  if any(iprobe.stats[i]["pruned_rows"] == 0 for i in sparse_layers):
    reasons.append("a sparse layer pruned nothing")
  if index_gap < base.MIN_INDEX_REL_GAP:
    reasons.append(f"indexer rel gap {index_gap:.2e}")
  if router_gap < base.MIN_ROUTER_GAP:
    reasons.append(f"router gap {router_gap:.2e}")
  if margin < base.MIN_ARGMAX_MARGIN:
    reasons.append(f"greedy margin {margin:.2e}")
  distinct = [len(set(g["tokens"])) for g in gens]
  if min(distinct) < GEN_NEW_TOKENS // 3:
    reasons.append(f"degenerate greedy continuation ({distinct} distinct tokens)")
  hf_quant_equal = bool(torch.equal(hf_quant_logits, logits))
  if not hf_quant_equal:  # not a seed problem: HF reads the quantized files differently from our dequantization
    raise AssertionError(f"HF's load of the quantized checkpoint differs from the dequantized one by "
                         f"{float((hf_quant_logits - logits).abs().max())}")
  return not reasons, dict(qdir=qdir, ids=ids, logits=logits, gens=gens, reasons=reasons, index_gap=index_gap,
                           router_gap=router_gap, margin=margin, n_quantized=n_quantized, config=config,
                           quant=quant, deq=deq, index_stats=iprobe.stats, tc=tc)


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
  return sum(t.numel() * t.element_size() for t in tensors.values())


def make_fixture(spec: QuantFixture, out_dir: str, max_tries: int) -> dict[str, Any]:
  rejected = []
  with tempfile.TemporaryDirectory() as work:
    for attempt in range(max_tries):
      seed = spec.base_seed + attempt
      ok, res = evaluate_seed(spec, seed, work)
      print(f"[{spec.name}] seed {seed}: index_gap={res['index_gap']:.3e} router_gap={res['router_gap']:.3e} "
            f"margin={res['margin']:.3e} {'OK' if ok else res['reasons']}", flush=True)
      if ok:
        break
      rejected.append(dict(seed=seed, reasons=res["reasons"]))
    else:
      raise RuntimeError(f"{spec.name}: no acceptable seed in {max_tries} tries")
    fdir = os.path.join(out_dir, spec.name)
    shutil.rmtree(fdir, ignore_errors=True)
    os.makedirs(fdir)
    shutil.copytree(res["qdir"], os.path.join(fdir, "checkpoint"))
  tc = res["tc"]
  positions = logit_positions(spec, tc.index_block_size, tc.index_topk_blocks)
  np.savez_compressed(os.path.join(fdir, "reference.npz"),
                      input_ids=res["ids"].to(torch.int32).numpy(),
                      logit_positions=positions.astype(np.int32),
                      logits=res["logits"][:, positions].numpy().astype(np.float32),
                      gen_prompt_lens=np.asarray(spec.gen_prompt_lens, np.int32),
                      gen_tokens=np.asarray([g["tokens"] for g in res["gens"]], np.int32))
  quantized = {k: v for k, v in res["quant"].items() if k.startswith("language_model.model.layers.")
               and (k.endswith(q.SCALE_INV) or k[: -len(".weight")] + q.SCALE_INV in res["quant"])}
  represented = {k: v for k, v in res["deq"].items() if k[: -len(".weight")] + q.SCALE_INV in res["quant"]}
  meta = dict(
      name=spec.name, base_fixture=spec.base_fixture, format=spec.fmt, seed=seed, rejected_seeds=rejected,
      versions=dict(transformers=transformers.__version__, torch=torch.__version__, numpy=np.__version__,
                    python=sys.version.split()[0]),
      hf_class="MiniMaxM3SparseForConditionalGeneration", dtype="float32", attn_implementation="eager",
      quantization_config=spec.quantization_config, quantized_weights=res["n_quantized"],
      quantized_bytes=dict(fp8_values_and_scales=_nbytes(quantized), as_fp32=_nbytes(represented),
                           as_bf16=_nbytes(represented) // 2),
      quantizer="m3jax/checkpoint/quantized.py quantize_mxfp8 / quantize_fp8_block (round to nearest)",
      reference=("HF fp32 logits of the exactly dequantized weights; HF's own load of the quantized checkpoint "
                 "(dequantize on CPU) gives the same logits bit for bit"),
      hf_quantized_load_logits_bitwise_equal=True,
      logits="reference.npz logits[b, i] = HF logits[b, logit_positions[i]]",
      generation=dict(kind="forward greedy: argmax of a full no-cache forward per token (not HF generate)",
                      new_tokens=GEN_NEW_TOKENS, prompt_lens=list(spec.gen_prompt_lens),
                      prompts="input_ids[b, :gen_prompt_lens[b]], batch 1 each",
                      min_argmax_margin=[g["min_margin"] for g in res["gens"]]),
      robustness=dict(min_rel_indexer_gap=res["index_gap"], min_router_gap=res["router_gap"],
                      min_argmax_margin=res["margin"],
                      pruned_query_rows={str(k): v["pruned_rows"] for k, v in res["index_stats"].items()}),
      text_config=base.parsed_text_summary(tc),
      files={os.path.relpath(os.path.join(r, f), fdir): _sha256(os.path.join(r, f))
             for r, _, fs in os.walk(fdir) for f in sorted(fs)},
  )
  with open(os.path.join(fdir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
    f.write("\n")
  return meta


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out-dir", default="tests/fixtures", help="where <name>/ fixture folders are written")
  ap.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="build only these fixtures")
  ap.add_argument("--max-seed-tries", type=int, default=20, help="seeds tried per fixture before giving up")
  args = ap.parse_args()
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  os.makedirs(args.out_dir, exist_ok=True)
  for name in args.only or list(FIXTURES):
    meta = make_fixture(FIXTURES[name], args.out_dir, args.max_seed_tries)
    print(json.dumps(dict(name=name, seed=meta["seed"], robustness=meta["robustness"],
                          bytes=meta["quantized_bytes"]), indent=None))


if __name__ == "__main__":
  main()
