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
# # M3's vision path: image -> patches -> merged tokens -> the prompt
#
# An image is resized so both sides are multiples of 28 (`smart_resize`), cut into 14x14 patches (each still
# image duplicated to 2 frames, so one patch row has 3*2*14*14 = 1176 values), encoded by the vision tower with
# attention restricted to the image's own patches, and every 2x2 block of patches is merged into one LLM
# token that replaces one `]<]image[>[` placeholder in the prompt. This notebook walks through that on the
# tiny built-in checkpoint (random weights).

# %%
import tempfile

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from PIL import Image

import m3jax
from m3jax.demo import build_demo_checkpoint
from m3jax.tokenizer import load_tokenizer
from m3jax.vision import (IMAGE_MARKER, build_multimodal_inputs, smart_resize, vision_features, vision_layout)
from m3jax.vision.grid import block_order_hw

ckpt = build_demo_checkpoint(tempfile.mkdtemp() + "/tiny-m3")
model = m3jax.load(ckpt)
tok = load_tokenizer(ckpt)
rng = np.random.default_rng(0)
y, x = np.mgrid[0:150, 0:220]
gradient = np.stack([x / 220 * 255, y / 150 * 255, 128 + 0 * x], -1).astype(np.uint8)
images = [Image.fromarray(gradient), Image.fromarray((rng.random((60, 60, 3)) * 255).astype(np.uint8))]
for im in images:
  print(im.size, "-> smart_resize (h, w) =", smart_resize(im.height, im.width))

# %% [markdown]
# ## Patches and merge blocks
# Patches are listed in *spatial-merge-block* order: each run of 4 consecutive patches is one 2x2 block,
# which becomes one token. The numbers show the order of the first image's patches.

# %%
inputs = build_multimodal_inputs(IMAGE_MARKER + " and " + IMAGE_MARKER + " are two pictures.", tok, images=images,
                                 image_token_id=model.config.image_token_id)
grids = inputs.image_grid_thw
print("pixel_values", inputs.pixel_values.shape, "image_grid_thw", grids.tolist())
t, gh, gw = grids[0]
hp, wp = block_order_hw(int(gh), int(gw), 2)
order = np.zeros((gh, gw), int)
order[hp, wp] = np.arange(gh * gw)
fig, ax = plt.subplots(figsize=(6, 4))
ax.imshow(order // 4, cmap="tab20")
for (r, c), v in np.ndenumerate(order):
  ax.text(c, r, v, ha="center", va="center", fontsize=7)
ax.set(title="patch order (colour = merged token)", xlabel="patch column", ylabel="patch row")
plt.show()

# %% [markdown]
# ## Attention segments
# The tower packs several images into one batch, but each image attends only within itself (HF's
# `cu_seqlens`). The block-diagonal mask below is what the packed layout allows.

# %%
layout = vision_layout(grids, merge=2, max_frames=model.config.vision.segment_max_frames)
print("segments (start, length):", layout.segments)
n = layout.num_patches
mask = np.zeros((n, n), bool)
for start, length in layout.segments:
  mask[start:start + length, start:start + length] = True
plt.imshow(mask, cmap="Greys")
plt.title("which patch may attend to which")
plt.show()

# %% [markdown]
# ## Merged tokens and where they land in the prompt
# `gh * gw / 4` features per image, scattered in order into the placeholder tokens between the start and end
# markers; positions stay plain 1-D for the language model.

# %%
features = vision_features(model.vision, inputs.pixel_values, grids)
print("merged features:", features.shape, "= sum of gh*gw/4 =", int((grids[:, 1] * grids[:, 2]).sum() // 4))
ids = inputs.input_ids[0]
is_image = ids == model.config.image_token_id
plt.figure(figsize=(10, 1.5))
plt.imshow(is_image[None], aspect="auto", cmap="Greys")
plt.yticks([])
plt.xlabel("prompt position (black = image placeholder)")
plt.show()
print(repr(tok.decode(ids.tolist())[:120]), "...")

# %% [markdown]
# ## The images change the model's output
# The same prompt with and without the pixels (text-only embeddings of the placeholders). `model(ids)` refuses
# placeholders without their pixels; `model.forward` embeds them as ordinary tokens.

# %%
with_images = np.asarray(model(inputs.input_ids, **inputs.pixel_kwargs()))
text_only = np.asarray(model.forward(jnp.asarray(inputs.input_ids)).logits)
print("max |logit difference| at the last position:", np.abs(with_images[0, -1] - text_only[0, -1]).max())
assert np.abs(with_images - text_only).max() > 0
