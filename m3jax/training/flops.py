"""Model FLOPs of a training step (the numerator of model FLOP utilisation), counted from the config.

Per token, forward: 2 x every weight a token multiplies (q/k/v/o and indexer projections, the dense MLP or the
K routed experts + shared expert + router, the LM head; the MTP module's eh_proj, layer and LM head), plus the
attention itself: 2 x 2 x heads x head_dim per attended key (QK^T and PV), where a dense layer attends to
(p + 1) keys and a sparse layer to min(p + 1, top-k x block) keys, and the indexer scores every visible key
(2 x index heads x index dim). Training = 3 x forward (backward ~2 x forward). The alignment record's extra dense
attention (training overhead, not model work) is not counted.
"""

from __future__ import annotations

from m3jax.config import M3Config


def _mean_keys(seq_len: int, cap: int | None) -> float:
  """Mean over positions p in [0, seq_len) of min(p + 1, cap)."""
  total = sum(min(p + 1, cap) if cap else p + 1 for p in range(seq_len))
  return total / seq_len


def forward_flops_per_token(cfg: M3Config, seq_len: int, with_mtp: bool) -> float:
  """Forward FLOPs per token of the trunk (plus the first MTP module with ``with_mtp``) at rows of seq_len."""
  t = cfg.text
  h, d = t.hidden_size, t.head_dim
  attn_proj = h * d * (2 * t.num_heads + 2 * t.num_kv_heads)
  index_proj = h * t.index_head_dim * (t.index_num_heads + 1)
  dense_mlp = 3 * h * t.dense_intermediate_size
  moe_mlp = 3 * h * (t.num_experts_per_tok * t.intermediate_size + t.shared_intermediate_size) + h * t.num_experts
  dense_keys = _mean_keys(seq_len, None)
  sparse_keys = _mean_keys(seq_len, t.index_topk_blocks * t.index_block_size)
  attn_per_key = 2 * 2 * t.num_heads * d
  index_per_key = 2 * t.index_num_heads * t.index_head_dim

  def layer(sparse: bool, moe: bool) -> float:
    macs = attn_proj + (index_proj if sparse else 0) + (moe_mlp if moe else dense_mlp)
    flops = 2 * macs + attn_per_key * (sparse_keys if sparse else dense_keys)
    return flops + (index_per_key * dense_keys if sparse else 0)

  total = sum(layer(a == "sparse", m == "moe") for a, m in zip(t.attention_types, t.mlp_types))
  head = 2 * h * t.vocab_size
  total += head
  if with_mtp and t.num_mtp_modules:
    total += 2 * 2 * h * h + layer(True, True) + head
  return float(total)


def train_flops_per_token(cfg: M3Config, seq_len: int, with_mtp: bool) -> float:
  """Forward + backward model FLOPs per trained token (3 x forward)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len, with_mtp)
