"""HF transformers' fp32 logits of a checkpoint directory (e.g. an ``m3jax export``, quantized or not): a check
that HF loads what m3jax writes. Run with the HF reference venv (torch CPU + transformers 5.23.0; FP8 / MXFP8
checkpoints also need accelerate: HF dequantizes them on a CPU)::

  /work/venvref/bin/python scripts/hf_logits.py CKPT IDS.npz OUT.npz

IDS.npz holds ``input_ids`` int [B, S]; OUT.npz gets ``logits`` fp32 [B, S, V] and the quantization_config HF read.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import transformers
from transformers import MiniMaxM3SparseForConditionalGeneration


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("checkpoint")
  ap.add_argument("ids")
  ap.add_argument("out")
  args = ap.parse_args()
  transformers.logging.set_verbosity_error()
  torch.set_num_threads(1)
  model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(args.checkpoint, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
  ids = torch.from_numpy(np.load(args.ids)["input_ids"].astype(np.int64))
  with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits.float().numpy()
  qc = getattr(model.config, "quantization_config", None)
  qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
  np.savez(args.out, logits=logits, quantization_config=json.dumps(qc, default=str))
  print(f"{args.checkpoint}: logits {list(logits.shape)}, quantization_config {json.dumps(qc, default=str)}")


if __name__ == "__main__":
  main()
