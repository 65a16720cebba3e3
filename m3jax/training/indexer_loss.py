"""The lightning indexer's alignment loss: the indexer learns to predict where dense attention puts its mass.

For every sparse layer, query token t and KV group g (= index head g), the target is the dense causal attention
mass of the group's query heads per key block (m3jax.research.block_attention_mass: summed over the heads,
divided by their number, so it sums to 1), and the prediction is the softmax of the indexer's block-max scores
over the visible blocks. The loss is KL(target || softmax(scores)), averaged over the (token, group) rows that
have a choice (at least two candidate blocks). The target carries no gradient and the indexer reads the layer
input with its gradient stopped (``Collect(indexer_alignment=True)``), so the loss trains the indexer's own
weights and nothing else, and the language-model loss does not reach the indexer (top-k is discrete).

Phases, as DeepSeek-V3.2 trains its lightning indexer (its technical report, continued pre-training: a dense warm-up stage with the
main model's attention dense, then sparse training with the KL restricted to the selected set):
  * dense warm-up (``selected=None``): sparse layers attend densely; the KL runs over every visible block.
  * sparse phase (``selected`` = the layer's block_ids): sparse layers attend to the indexer's top-k; target
    and prediction are both renormalised over the selected blocks, so the indexer keeps ranking its own picks
    by the mass they get.

What is known of M3 itself: its released checkpoints and the HF / vLLM code define the indexer's inference
math only (M3_SPEC §3: no scale, no ReLU, no per-head weights, max-pooled blocks, top-16 of 128-key blocks);
how MiniMax trained it is not published. The max-pooled block score, the per-group target (summed over the
group's 16 heads, since one index head serves one KV group) and the two phases are m3jax's choice, carried over
from DeepSeek-V3.2's token-level recipe to M3's block-level selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def selected_block_mask(block_ids: jax.Array, num_blocks: int) -> jax.Array:
  """block_ids int [B, S, G, T] (-1 = empty slot) -> bool [B, S, G, nb]: the blocks each row selected."""
  hits = (block_ids[..., None] == jnp.arange(num_blocks, dtype=block_ids.dtype)) & (block_ids[..., None] >= 0)
  return jnp.any(hits, axis=-2)


def indexer_alignment_loss(target: jax.Array, scores: jax.Array, selected: jax.Array | None = None
                           ) -> jax.Array:
  """KL(block attention mass || softmax of the indexer's block scores), averaged over rows with a choice.

  Args:
    target: fp32 [B, S, G, nb] dense attention mass per key block (``alignment_target``; rows sum to 1).
    scores: fp32 [B, S, G, nb] indexer block-max scores (``alignment_scores``; -inf = block not visible).
    selected: optional block_ids int [B, S, G, T] of the sparse phase: both distributions are restricted to
      (and renormalised over) the selected blocks. None: the dense warm-up phase, over every visible block.

  Returns:
    fp32 scalar (nats); 0 when no row has two candidate blocks.
  """
  if target.shape != scores.shape:
    raise ValueError(f"alignment target {target.shape} and scores {scores.shape} differ")
  candidates = jnp.isfinite(scores)
  if selected is not None:
    if selected.shape[:3] != scores.shape[:3]:
      raise ValueError(f"selected blocks {selected.shape} do not match scores {scores.shape} on [B, S, G]")
    candidates &= selected_block_mask(selected, scores.shape[-1])
  p = jnp.where(candidates, jax.lax.stop_gradient(target.astype(jnp.float32)), 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  log_q = jax.nn.log_softmax(jnp.where(candidates, scores.astype(jnp.float32), -jnp.inf), axis=-1)
  terms = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.where(candidates, log_q, 0.0)), 0.0)
  kl = jnp.sum(terms, axis=-1)  # [B, S, G]
  rows = (jnp.sum(candidates, axis=-1) >= 2).astype(jnp.float32)
  return jnp.sum(kl * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def alignment_loss_of_records(records, sparse_phase: bool) -> tuple[jax.Array, int]:
  """Mean alignment loss over the layer records that hold an alignment pair (sparse layers of a forward with
  ``Collect(indexer_alignment=True)``, plus ``block_ids`` in the sparse phase); (loss, number of layers)."""
  losses = []
  for rec in records:
    if "alignment_target" not in rec:
      continue
    selected = rec.get("block_ids") if sparse_phase else None
    if sparse_phase and selected is None:
      raise ValueError("the sparse phase needs the layers' block_ids (Collect(block_ids=True))")
    losses.append(indexer_alignment_loss(rec["alignment_target"], rec["alignment_scores"], selected))
  if not losses:
    return jnp.zeros((), jnp.float32), 0
  return jnp.mean(jnp.stack(losses)), len(losses)
