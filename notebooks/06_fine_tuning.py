# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training and fine-tuning an M3 on CPU
#
# The modules m3jax serves are the modules it trains: `m3jax.training.train` (the `m3jax train` command) runs
# the M3 forward pass on its pure-jnp reference ops under `jax.value_and_grad`, with AdamW on fp32 master
# weights, the lightning indexer's alignment loss, the MTP loss and auxiliary-loss-free router balancing
# (docs/training.md).
#
# This notebook trains a tiny M3 (two layers: full attention + dense MLP, sparse attention + MoE, and an MTP
# module; 0.34 M parameters) on this repository's README for a hundred steps of 4 rows (about 17 passes over its ~3K
# tokens: it learns them by heart), then fine-tunes the result on another text (docs/training.md), and plots the loss curves. A CPU does both in about a minute. The same
# `init_from` fine-tunes the packaged small trained M3 (`m3jax.demo.trained_demo_checkpoint()`, 7 M parameters),
# only more slowly on a CPU.

# %%
import dataclasses
import json
import pathlib
import tempfile

import matplotlib.pyplot as plt
import numpy as np

import m3jax
from m3jax.training import TrainConfig, train

work = pathlib.Path(tempfile.mkdtemp(prefix="m3jax-training-"))
pretrain_text, finetune_text = work / "readme.txt", work / "training.txt"
pretrain_text.write_text(pathlib.Path("../README.md").read_text())  # paragraphs (blank-line separated) are documents
finetune_text.write_text(pathlib.Path("../docs/training.md").read_text())

tiny = m3jax.tiny(mtp=True)  # blocks of 16 keys, top-2: the selection is live past 32 tokens
config = dataclasses.replace(tiny, text=dataclasses.replace(
    tiny.text, num_layers=2, attention_types=("full", "sparse"), mlp_types=("dense", "moe"), max_position_embeddings=128))

# %% [markdown]
# ## Training from scratch
#
# A byte-level BPE tokenizer is trained on the text; the documents are packed into rows of 128 tokens; a seeded
# 10 % of them is held out. The first 30 steps are the indexer's dense warm-up (sparse layers attend densely while
# the indexer learns where dense attention puts its mass), then the sparse phase.

# %%
pretrain = train(config, pretrain_text, work / "pretrain", TrainConfig(
    steps=100, batch=4, seq_len=128, learning_rate=3e-3, warmup_steps=10, indexer_warmup_steps=30, eval_every=25,
    eval_batches=2, checkpoint_every=100, holdout_fraction=0.1, compute_dtype="float32", save_dtype="float32",
    router_bias_rate=1e-2, progress=False))
print(f"{pretrain.params:,} parameters, {pretrain.train_tokens:,} training tokens; validation loss "
      f"{pretrain.val_loss:.3f} (perplexity {pretrain.val_ppl:.1f})")

# %% [markdown]
# ## Fine-tuning
#
# `init_from` starts from a checkpoint: its config, tokenizer and weights (here the model just trained), with a
# lower learning rate and no indexer warm-up (the indexer is already trained).

# %%
finetune = train(None, finetune_text, work / "finetune", TrainConfig(
    init_from=pretrain.model_dir, steps=60, batch=4, seq_len=128, learning_rate=1e-3, warmup_steps=5,
    indexer_warmup_steps=0, eval_every=10, eval_batches=2, checkpoint_every=60, holdout_fraction=0.1,
    compute_dtype="float32", save_dtype="float32", router_bias_rate=1e-2, progress=False))
print(f"fine-tuned: validation loss {finetune.val_loss:.3f} (perplexity {finetune.val_ppl:.1f})")

# %% [markdown]
# Every step and every evaluation is a line of `metrics.jsonl`: the total objective, its parts (next-token
# loss, MTP loss, the indexer's KL to dense attention's block mass), the gradient norm, the learning rate and
# each MoE layer's expert load.

# %%
def read(result):
  records = [json.loads(line) for line in pathlib.Path(result.metrics_path).read_text().splitlines()]
  return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


fig, axes = plt.subplots(1, 3, figsize=(16, 4))
offset = 0
for name, result in (("training", pretrain), ("fine-tuning", finetune)):
  steps_, vals = read(result)
  x = [offset + r["step"] for r in steps_]
  axes[0].plot(x, [r["lm_loss"] for r in steps_], alpha=0.6, label=f"{name}: train next-token loss")
  axes[0].plot([offset + r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", label=f"{name}: validation")
  axes[1].plot(x, [r["indexer_loss"] for r in steps_], label=name)
  loads = np.array([r["expert_load"] for r in steps_])  # [steps, MoE layers, experts]
  axes[2].plot(x, loads.max(axis=(1, 2)) * loads.shape[-1], label=name)
  offset = x[-1]
axes[0].set_ylabel("cross-entropy (nats)")
axes[0].legend(fontsize=8)
axes[1].set_title("indexer alignment KL")
axes[1].legend()
axes[2].axhline(1.0, color="gray", lw=0.5)
axes[2].set_title("busiest expert's load / mean load")
axes[2].legend()
for a in axes:
  a.set_xlabel("step")
plt.tight_layout()
plt.show()
steps_, _ = read(pretrain)
first, last = np.mean([r["lm_loss"] for r in steps_[:10]]), np.mean([r["lm_loss"] for r in steps_[-10:]])
print(f"training next-token loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
assert last < first

# %% [markdown]
# The result is a normal m3jax checkpoint: load it and continue a prompt greedily.

# %%
from m3jax.tokenizer import load_tokenizer  # noqa: E402

model = m3jax.load(finetune.model_dir)
tok = load_tokenizer(finetune.model_dir)
prompt = "The indexer"
ids = np.asarray([[model.config.text.bos_token_id] + tok.encode(prompt).ids], np.int32)
out = m3jax.generate(model, ids, max_new_tokens=24)
print(prompt + tok.decode(np.asarray(out.tokens)[0].tolist()))
