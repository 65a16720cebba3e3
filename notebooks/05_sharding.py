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
# # Sharding M3 over a mesh (8 simulated devices on a CPU)
#
# Full M3 (~855 GB in bf16) needs 8 H200s. m3jax shards it with `jax.sharding` meshes: tensor parallelism over
# heads and MLP widths, expert parallelism over the routed experts, data parallelism over the batch. This
# notebook simulates 8 devices on the CPU (the flag must be set before jax is imported), plans the per-device
# memory of the full model, and checks that a sharded forward equals the unsharded one on a tiny model.

# %%
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import m3jax
from m3jax import sharding
from m3jax.parallel.memory import plan_memory

print(jax.devices())

# %% [markdown]
# ## Per-device memory of the full model
# `plan_memory` (also `m3jax inspect CKPT --mesh ...`) counts weight and cache bytes per device from the
# logical axis names every parameter carries, without allocating anything.

# %%
full = m3jax.m3_full()
meshes = ["tensor=8", "expert=8", "expert=4,tensor=2"]
plans = {m: plan_memory(full, m, batch=8, context=32768) for m in meshes}
fig, ax = plt.subplots(figsize=(7, 3))
for i, (m, p) in enumerate(plans.items()):
  left = 0.0
  for comp, b in sorted(p.weights.items(), key=lambda kv: -kv[1]):
    ax.barh(i, b / 2**30, left=left, label=comp if i == 0 else None)
    left += b / 2**30
  cache = sum(p.cache.values()) / 2**30
  ax.barh(i, cache, left=left, color="k", label="KV + index cache (8 x 32K)" if i == 0 else None)
  print(f"{m:20s} weights {sum(p.weights.values()) / 2**30:6.1f} GiB + cache {cache:5.1f} GiB per device")
ax.set_yticks(range(len(meshes)), meshes)
ax.set_xlabel("GiB per device (bf16)")
ax.axvline(141e9 / 2**30, color="r", ls=":", label="H200 memory")
ax.legend(fontsize=7, loc="lower right")
plt.show()

# %% [markdown]
# ## Where the parameters go
# The rules table maps logical names to mesh axes; here is the layout of a few parameters on an
# `expert=4, tensor=2` mesh.

# %%
mesh = sharding.make_mesh("expert=4,tensor=2")
plan = sharding.ShardingPlan(mesh, sharding.RULES)
abstract = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(m3jax.tiny(), dtype=jnp.float32))
shown = {("layers", 1, "attn", "q_proj"), ("layers", 1, "attn", "k_proj"), ("layers", 1, "mlp", "w_gate_up"),
         ("layers", 1, "mlp", "shared", "gate_up"), ("lm_head",)}
for path, var in nnx.to_flat_state(nnx.state(abstract)):
  if path in shown:
    names = sharding.logical_axes_of(var)
    print(f"{'/'.join(map(str, path)):28s} {str(var.shape):14s} {names} -> {plan.spec(names)}")

# %% [markdown]
# ## A sharded forward equals the unsharded one

# %%
model = m3jax.M3ForCausalLM(m3jax.tiny(block_size=16), dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
ids = jax.random.randint(jax.random.key(0), (2, 96), 0, 512)
single = np.asarray(model(ids))
for mesh_text in ["tensor=8", "expert=8", "data=2,tensor=4", "expert=4,tensor=2"]:
  copy = nnx.merge(*nnx.split(model))
  sharded = sharding.shard_model(copy, sharding.make_mesh(mesh_text))
  out = np.asarray(sharded(ids))
  bytes_per_device = sharding.per_device_bytes(nnx.state(sharded))
  print(f"{mesh_text:18s} max |diff| / max |ref| = {np.abs(out - single).max() / np.abs(single).max():.1e}; "
        f"parameter bytes per device {min(bytes_per_device.values())}..{max(bytes_per_device.values())}")
  assert np.abs(out - single).max() <= 1e-5 * np.abs(single).max()
