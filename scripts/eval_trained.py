"""What a trained M3-architecture model's mechanisms do on held-out text (issue #48's measurements).

On the validation split that ``m3jax train`` held out (same corpus, holdout fraction and seed, re-derived here):

* indexer recall: the share of each sparse layer's dense causal attention mass that falls inside the indexer's
  top-k blocks (1 - ``m3jax.research.mass_outside_selection``), averaged over heads and the queries of the last
  ``--queries`` positions of each row (early queries see fewer blocks than top-k and keep everything);
* selection locality (``m3jax.research.selection_locality``): mean selected blocks and 4- / 8-query unions, the
  quantities that bound the sparse prefill kernel (BENCHMARKS.md, "Sparse prefill against selection locality");
  the selections of one row are saved as ``--save-selections`` for ``scripts/bench_attention.py --selections``;
* routing: each MoE layer's expert load (share of the routed slots) and its max / mean;
* MTP: greedy speculative decoding (``generate_speculative``) from held-out prompts with 1-3 drafts per round:
  per-draft acceptance rate and tokens per target forward; the greedy tokens must equal ``generate``'s (checked);
  with ``--time`` also the wall time of both (on a GPU: the speedup of this small model's loop);
* the validation loss / perplexity of the checkpoint (next-token, the trainer's definition).

  python scripts/eval_trained.py m3jax/assets/m3-small-kjv --corpus data/kjv/kjv.txt --out eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax.generate import generate
from m3jax.research import Collect, mass_outside_selection, selection_locality
from m3jax.speculative import generate_speculative
from m3jax.training import data
from m3jax.training.losses import lm_loss


def validation_rows(model_dir: str, corpus: str, holdout: float, seed: int, seq_len: int) -> np.ndarray:
  """int32 [N, seq_len]: the held-out documents packed as the trainer packed them."""
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

  tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
  _, val_docs = data.split_documents(data.read_documents(corpus), holdout, seed)
  cfg = json.load(open(f"{model_dir}/config.json"))
  text = cfg.get("text_config", cfg)
  eos = text["eos_token_id"][0] if isinstance(text["eos_token_id"], list) else text["eos_token_id"]
  return data.pack_documents([e.ids for e in tok.encode_batch(val_docs)], seq_len, text["bos_token_id"], eos,
                             "validation").rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("model", help="an m3jax checkpoint with its MTP module (e.g. m3jax/assets/m3-small-kjv)")
  ap.add_argument("--corpus", required=True, help="the training corpus (the validation split is re-derived)")
  ap.add_argument("--holdout", type=float, default=0.02)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--rows", type=int, default=8, help="validation rows to measure")
  ap.add_argument("--queries", type=int, default=128, help="last queries of each row for the recall")
  ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for the MTP acceptance")
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--drafts", default="1,2,3")
  ap.add_argument("--time", action="store_true", help="also time generate vs generate_speculative (3 calls each)")
  ap.add_argument("--save-selections", default=None, metavar="F.npz")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()

  model = m3jax.load(args.model, with_mtp=True, kernels="reference")
  tcfg = model.config.text
  rows = validation_rows(args.model, args.corpus, args.holdout, args.seed, args.seq_len)[: args.rows]
  result: dict = {"model": args.model, "device": jax.devices()[0].device_kind, "validation_rows": len(rows)}

  loss = float(lm_loss(model, jnp.asarray(rows)))
  result["val_loss"], result["val_ppl"] = loss, math.exp(loss)

  s = rows.shape[1]
  start = s - args.queries
  out = model.forward(jnp.asarray(rows), collect=Collect(block_ids=True, routing=True,
                                                         attention_queries=(start, s)))
  sparse = [i for i, t in enumerate(tcfg.attention_types) if t == "sparse"]
  recall = {str(i): float(1.0 - jnp.mean(mass_outside_selection(out.intermediates, i))) for i in sparse}
  result["indexer_recall"] = recall
  result["indexer_recall_mean"] = float(np.mean(list(recall.values())))
  result["blocks"] = {"block_size": tcfg.index_block_size, "topk": tcfg.index_topk_blocks,
                      "row_blocks": s // tcfg.index_block_size}
  positions = np.broadcast_to(np.arange(s, dtype=np.int32), rows.shape)
  result["locality"] = {str(i): {str(q): v for q, v in selection_locality(
      out.intermediates[i]["block_ids"], positions).items()} for i in sparse}
  if args.save_selections:
    np.savez_compressed(args.save_selections, positions=positions[:1],
                        **{f"layer_{i}": np.asarray(out.intermediates[i]["block_ids"])[:1] for i in sparse})

  loads = {}
  for i, rec in enumerate(out.intermediates):
    if "expert_ids" in rec:
      counts = np.bincount(np.asarray(rec["expert_ids"]).ravel(), minlength=tcfg.num_experts)
      share = counts / counts.sum()
      loads[str(i)] = {"share": [round(float(x), 4) for x in share],
                       "max_over_mean": float(share.max() * len(share))}
  result["expert_load"] = loads

  prompts = [r[1:1 + args.prompt_len].tolist() for r in
             validation_rows(args.model, args.corpus, args.holdout, args.seed, args.seq_len)[-args.prompts:]]
  plain = generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_ids=())
  mtp = {}
  for k in (int(x) for x in args.drafts.split(",")):
    spec = generate_speculative(model, prompts, max_new_tokens=args.new_tokens, num_draft_tokens=k,
                                eos_token_ids=())
    row = {"acceptance_rate": spec.acceptance_rate, "tokens_per_round": spec.tokens_per_round,
           "greedy_equal_generate": bool(np.array_equal(spec.tokens, plain.tokens))}
    if args.time:
      def timed(fn):
        fn()  # compiled already; one more call to warm
        t = []
        for _ in range(3):
          t0 = time.perf_counter()
          fn()
          t.append(time.perf_counter() - t0)
        return min(t)
      row["speculative_s"] = timed(lambda: generate_speculative(
          model, prompts, max_new_tokens=args.new_tokens, num_draft_tokens=k, eos_token_ids=()).tokens)
      row["generate_s"] = timed(lambda: generate(model, prompts, max_new_tokens=args.new_tokens,
                                                 eos_token_ids=()).tokens)
      row["speedup"] = row["generate_s"] / row["speculative_s"]
    mtp[str(k)] = row
  result["mtp"] = mtp
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
