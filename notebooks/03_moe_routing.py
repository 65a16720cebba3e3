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
# # M3's MoE routing
#
# M3 routes each token to 4 of 128 experts with a sigmoid router: a correction bias is added to the scores to
# *choose* the experts, the unbiased scores of the chosen ones are renormalised into the weights, scaled by 2,
# and a shared expert is added for every token. This notebook records the routing with the research API on a
# tiny model (8 experts, top-2) and looks at expert load, routing entropy, what the bias changes, and the
# shared vs routed contributions.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import m3jax
from m3jax.research import Collect
from pallas_kernels.moe.reference import route_reference

model = m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
cfg = model.config.text
ids = jax.random.randint(jax.random.key(1), (4, 128), 0, cfg.vocab_size)
out = model.forward(ids, collect=Collect(routing=True, residual=True))
moe_layers = [i for i, kind in enumerate(cfg.mlp_types) if kind == "moe"]
print("MoE layers:", moe_layers)

# %% [markdown]
# ## Expert load per layer

# %%
fig, axes = plt.subplots(1, len(moe_layers), figsize=(4 * len(moe_layers), 3))
for ax, layer in zip(np.atleast_1d(axes), moe_layers):
  chosen = np.asarray(out.intermediates[layer]["expert_ids"]).reshape(-1)
  load = np.bincount(chosen, minlength=cfg.num_experts) / chosen.size
  ax.bar(range(cfg.num_experts), load)
  ax.axhline(1 / cfg.num_experts, color="k", ls=":")
  ax.set(title=f"layer {layer}: share of routed slots", xlabel="expert")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Routing entropy
# Entropy of the renormalised routing weights of each token (0 = one expert takes everything;
# log(top_k) = an even split) and of the full sigmoid distribution over all experts.

# %%
for layer in moe_layers:
  rec = out.intermediates[layer]
  w = np.asarray(rec["expert_weights"])
  h_topk = -(w * np.log(w)).sum(-1)
  p = jax.nn.sigmoid(rec["router_logits"])
  p = np.asarray(p / p.sum(-1, keepdims=True))
  h_all = -(p * np.log(p)).sum(-1)
  print(f"layer {layer}: top-k weight entropy {h_topk.mean():.3f} (max {np.log(cfg.num_experts_per_tok):.3f}); "
        f"all-expert entropy {h_all.mean():.3f} (max {np.log(cfg.num_experts):.3f})")

# %% [markdown]
# ## What the correction bias changes
# The bias only changes *which* experts are chosen. Here we give one expert a large bias and count how often
# the selection changes; the weights are still the renormalised unbiased sigmoid scores.

# %%
layer = moe_layers[0]
mlp = model.layers[layer].mlp
x = out.intermediates[layer - 1]["residual"] if layer > 0 else model.embed_tokens(ids)
x = model.layers[layer].post_attention_norm(x + 0)  # an approximation of the MoE input, for illustration
flat = x.reshape(-1, cfg.hidden_size)
base_w, base_ids, _ = route_reference(flat, mlp.router[...], jnp.zeros(cfg.num_experts), top_k=cfg.num_experts_per_tok)
bias = jnp.zeros(cfg.num_experts).at[3].set(1.0)
new_w, new_ids, _ = route_reference(flat, mlp.router[...], bias, top_k=cfg.num_experts_per_tok)
changed = (np.sort(np.asarray(base_ids), -1) != np.sort(np.asarray(new_ids), -1)).any(-1).mean()
print(f"bias +1 on expert 3: {changed:.0%} of tokens change their expert set; expert 3 chosen by "
      f"{(np.asarray(new_ids) == 3).any(-1).mean():.0%} of tokens (was {(np.asarray(base_ids) == 3).any(-1).mean():.0%})")
np.testing.assert_allclose(np.asarray(new_w).sum(-1), 1.0, rtol=1e-6)

# %% [markdown]
# ## Shared vs routed contributions
# The MoE output is `2 * sum_k w_k E_k(x) + Shared(x)`; compare their norms per token.

# %%
shared = mlp.shared(x)
total = mlp(x)
routed = total - shared
ratio = np.asarray(jnp.linalg.norm(routed, axis=-1) / jnp.linalg.norm(shared, axis=-1)).reshape(-1)
plt.hist(ratio, bins=40)
plt.xlabel("|routed| / |shared| per token")
plt.show()
print(f"median |routed|/|shared| = {np.median(ratio):.2f}")
