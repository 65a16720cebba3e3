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
# # Inside M3's sparse attention
#
# On its 57 sparse layers M3 lets every query attend only to `top_k` key blocks of its KV group (16 blocks of
# 128 keys in the real model), picked by the lightning indexer; the query's own block is always kept. This
# notebook uses the research API (`forward(collect=Collect(...))`) on a tiny model (blocks of 16 keys, top-2,
# so pruning starts at position 32) to look at which blocks are picked, how much of the dense attention mass
# the selection keeps, and how `top_k` and the local blocks change that.

# %%
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import m3jax
from m3jax.research import Collect, mass_outside_selection

config = m3jax.tiny(block_size=16)
model = m3jax.M3ForCausalLM(config, dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
cfg = config.text
seq = 256
ids = jax.random.randint(jax.random.key(0), (1, seq), 0, cfg.vocab_size)
collect = Collect(block_ids=True, block_scores=True, attention_queries=(0, seq))
out = model.forward(ids, collect=collect)
sparse_layers = [i for i, kind in enumerate(cfg.attention_types) if kind == "sparse"]
print("sparse layers:", sparse_layers)

# %% [markdown]
# ## Block-selection heatmap
# For each query position (rows) and key block (columns): selected or not, for KV group 0 of the first
# sparse layer. The diagonal is the forced local block; everything above it is the future.

# %%
layer = sparse_layers[0]
rec = out.intermediates[layer]
nb = seq // cfg.index_block_size
selected = np.zeros((seq, nb))
ids_np = np.asarray(rec["block_ids"])[0, :, 0]  # [S, top_k]
for p in range(seq):
  for b in ids_np[p]:
    if b >= 0:
      selected[p, b] = 1
scores = np.asarray(rec["block_scores"])[0, :, 0]
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
axes[0].imshow(selected, aspect="auto", interpolation="nearest", cmap="Greys")
axes[0].set(title=f"layer {layer}, group 0: selected blocks", xlabel="key block", ylabel="query position")
axes[1].imshow(np.where(np.isfinite(scores), scores, np.nan), aspect="auto", interpolation="nearest")
axes[1].set(title="indexer block scores (max over the block)", xlabel="key block")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Coverage
# The fraction of the visible blocks that each query keeps: 1 until position `top_k * block_size`, then
# `top_k / (blocks so far)`.

# %%
visible = np.arange(seq) // cfg.index_block_size + 1
kept = (ids_np >= 0).sum(-1)
plt.plot(kept / visible, label="kept / visible blocks")
plt.axvline(cfg.index_topk_blocks * cfg.index_block_size, color="k", ls=":", label="top_k x block_size")
plt.xlabel("query position")
plt.legend()
plt.show()
print("coverage at the last position:", kept[-1] / visible[-1])

# %% [markdown]
# ## Dense attention mass outside the selection
# `mass_outside_selection` compares the sparse layer with dense causal attention on the same queries and
# keys: how much of the dense softmax mass falls in blocks the indexer dropped, per head and position.

# %%
for layer in sparse_layers:
  mass = np.asarray(mass_outside_selection(out.intermediates, layer))[0]  # [heads, positions]
  plt.plot(mass.mean(0), label=f"layer {layer} (mean over heads)")
  print(f"layer {layer}: mean mass outside selection after position 32: {mass[:, 32:].mean():.3f}, "
        f"worst head/position: {mass.max():.3f}")
plt.xlabel("query position")
plt.ylabel("dense mass outside the selected blocks")
plt.legend()
plt.show()

# %% [markdown]
# ## Selection locality: what the GPU kernel pays for a selection
# The Hopper prefill kernel gives a tile of Q adjacent queries (x the 16 heads of a KV group) one walk over the
# *union* of their selected blocks, and each union block costs the matrix work of all Q queries. So its useful
# share of the work is `selected / (Q x union)`: 1 when adjacent queries pick the same blocks, 1 / Q when they
# share none. `selection_locality` reports it per tile size; on a real checkpoint
# `m3jax forward CKPT --prompt-file long.txt --selection-stats` prints the same per layer. With M3's top-16 the
# kernel reaches 60 % of cuDNN's dense rate when the mean 4-query union is at most ~21 blocks at 32K tokens
# (BENCHMARKS.md, "Sparse prefill against selection locality"). Random weights give uncorrelated index queries,
# so expect poor locality here; what a trained indexer gives is the open question.

# %%
from m3jax.research import selection_locality  # noqa: E402

positions = np.arange(seq)[None]
for layer in sparse_layers:
  stats = selection_locality(out.intermediates[layer]["block_ids"], positions)
  for q, st in stats.items():
    print(f"layer {layer}, {q}-query tiles: {st['mean_selected']:.2f} blocks selected per query, "
          f"union {st['mean_union']:.2f} per tile, useful share of the work {st['row_efficiency']:.2f}")
    assert 1 / q - 1e-6 <= st["row_efficiency"] <= 1 + 1e-6
    assert st["mean_selected"] <= st["mean_union"] <= q * st["mean_selected"] + 1e-6

# %% [markdown]
# ## Effect of `top_k` and of the local blocks
# The same weights with other selection settings: more blocks keep more of the dense mass; forcing two local
# blocks spends one top-k slot on the previous block.

# %%
state = nnx.state(model)
results = {}
for topk, local in [(1, 1), (2, 1), (2, 2), (4, 1), (8, 1)]:
  text = dataclasses.replace(cfg, index_topk_blocks=topk, index_local_blocks=local)
  variant = nnx.merge(nnx.graphdef(nnx.eval_shape(
      lambda: m3jax.M3ForCausalLM(dataclasses.replace(config, text=text), dtype=jnp.float32, kernels="reference"))),
      state)
  o = variant.forward(ids, collect=Collect(attention_queries=(0, seq)))
  results[(topk, local)] = float(np.mean([np.asarray(mass_outside_selection(o.intermediates, l))[0, :, 64:].mean()
                                          for l in sparse_layers]))
for (topk, local), m in results.items():
  print(f"top_k={topk} local={local}: mean dense mass outside the selection (positions >= 64) = {m:.3f}")
assert results[(8, 1)] <= results[(2, 1)] <= results[(1, 1)]
