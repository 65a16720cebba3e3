# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fine-tuning an M3 on CPU
#
# The modules m3jax serves are the modules it trains: `m3jax.training.train` (the `m3jax train` command) runs
# the M3 forward pass on its pure-jnp reference ops under `jax.value_and_grad`, with AdamW on fp32 master
# weights, the lightning indexer's alignment loss, the MTP loss and auxiliary-loss-free router balancing.
#
# This notebook fine-tunes the small trained M3 the package carries (trained on the King James Bible by
# `scripts/train_small.sh`) on a different text, this repository's README, for a few hundred steps on CPU, and
# plots the loss curves. Without the packaged model it trains a tiny M3 from scratch instead (same API).

# %%
import json
import pathlib
import tempfile

import matplotlib.pyplot as plt
import numpy as np

import m3jax
import m3jax.demo
from m3jax.training import TrainConfig, train

readme = pathlib.Path("../README.md").read_text()
work = pathlib.Path(tempfile.mkdtemp(prefix="m3jax-finetune-"))
corpus = work / "readme.txt"
corpus.write_text(readme)  # paragraphs (blank-line separated) are the documents
base = m3jax.demo.trained_demo_checkpoint()
print("base model:", base or "none packaged: training a tiny M3 from scratch")

# %%
if base is not None:
  # Fine-tune: the base checkpoint's config, tokenizer and weights; a lower learning rate than pre-training.
  settings = TrainConfig(init_from=base, steps=150, batch=4, seq_len=256, learning_rate=3e-4, warmup_steps=15,
                         indexer_warmup_steps=0, eval_every=25, eval_batches=2, checkpoint_every=150,
                         compute_dtype="float32", save_dtype="float32", router_bias_rate=1e-2, progress=False)
  result = train(None, corpus, work / "run", settings)
else:
  import dataclasses

  tiny = m3jax.tiny(mtp=True)  # blocks of 16 keys, top-2: selection is live past 32 tokens
  text = dataclasses.replace(tiny.text, num_layers=2, attention_types=("full", "sparse"),
                             mlp_types=("dense", "moe"), max_position_embeddings=128)
  settings = TrainConfig(steps=150, batch=8, seq_len=128, learning_rate=3e-3, warmup_steps=15,
                         indexer_warmup_steps=30, eval_every=25, eval_batches=2, checkpoint_every=150,
                         compute_dtype="float32", save_dtype="float32", router_bias_rate=1e-2, progress=False)
  result = train(dataclasses.replace(tiny, text=text), corpus, work / "run", settings)
print(f"{result.params:,} parameters, {result.train_tokens:,} training tokens; validation loss "
      f"{result.val_loss:.3f} (perplexity {result.val_ppl:.1f})")

# %% [markdown]
# Every step and every evaluation is a line of `metrics.jsonl`: the total objective, its parts (next-token
# loss, MTP loss, the indexer's KL to dense attention's block mass), the gradient norm, the learning rate and
# each MoE layer's expert load.

# %%
records = [json.loads(line) for line in pathlib.Path(result.metrics_path).read_text().splitlines()]
train_rows = [r for r in records if "loss" in r]
val_rows = [r for r in records if "val_loss" in r]
steps = [r["step"] for r in train_rows]
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
axes[0].plot(steps, [r["lm_loss"] for r in train_rows], label="train next-token loss", alpha=0.7)
axes[0].plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation loss")
if "mtp_loss" in train_rows[0]:
  axes[0].plot(steps, [r["mtp_loss"] for r in train_rows], label="train MTP loss (token after next)", alpha=0.7)
axes[0].set_xlabel("step")
axes[0].set_ylabel("cross-entropy (nats)")
axes[0].legend()
axes[1].plot(steps, [r["indexer_loss"] for r in train_rows])
axes[1].set_xlabel("step")
axes[1].set_title("indexer alignment KL")
loads = np.array([r["expert_load"] for r in train_rows])  # [steps, MoE layers, experts]
axes[2].plot(steps, loads.max(axis=-1).max(axis=-1) * loads.shape[-1], label="busiest expert / mean")
axes[2].axhline(1.0, color="gray", lw=0.5)
axes[2].set_xlabel("step")
axes[2].set_title("router load balance")
axes[2].legend()
plt.tight_layout()
plt.show()
first, last = np.mean([r["lm_loss"] for r in train_rows[:10]]), np.mean([r["lm_loss"] for r in train_rows[-10:]])
print(f"next-token loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
assert last < first

# %% [markdown]
# The result is a normal m3jax checkpoint: load it and continue a prompt greedily.

# %%
from m3jax.tokenizer import load_tokenizer  # noqa: E402

model = m3jax.load(result.model_dir)
tok = load_tokenizer(result.model_dir)
prompt = "Sparse attention"
ids = np.asarray([[model.config.text.bos_token_id] + tok.encode(prompt).ids], np.int32)
out = m3jax.generate(model, ids, max_new_tokens=24)
print(prompt + tok.decode(np.asarray(out.tokens)[0].tolist()))
