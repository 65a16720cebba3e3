"""Tile and pipeline sizes for the lightning-indexer kernel (Hopper, Mosaic GPU) and a shape heuristic."""

from __future__ import annotations

import dataclasses

ROWS_PER_TILE = 64  # one wgmma M group: 16 queries x 4 index heads for M3
SMEM_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class IndexerBlockSizes:
  """Knobs of one indexer launch.

  kv_stages: TMA pipeline depth over 128-key blocks of idx_k (each stage is 128 x Di x 2 bytes).
  num_splits: CTAs per row tile along the key blocks (split-K, for decode); 1 for prefill.
  fused_topk: keep a running top-k per row in registers and write only block ids (prefill); when
    False the kernel writes fp32 block scores and the selection runs as lax.top_k (decode).
  """

  kv_stages: int = 2
  num_splits: int = 1
  fused_topk: bool = True

  def __post_init__(self):
    if not 1 <= self.kv_stages <= 8:
      raise ValueError(f"kv_stages must be in [1, 8], got {self.kv_stages}")
    if self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
    if self.fused_topk and self.num_splits != 1:
      raise ValueError("fused_topk needs num_splits == 1 (each CTA must see every block of its rows)")

  def smem_bytes(self, head_dim: int) -> int:
    """Shared memory of one CTA: the query tile plus the idx_k pipeline stages."""
    return ROWS_PER_TILE * head_dim * 2 + self.kv_stages * 128 * head_dim * 2 + 16 * ROWS_PER_TILE * 4 * 2


def heuristic_block_sizes(
    batch: int, num_row_tiles: int, num_blocks: int, *, num_sms: int = 132
) -> IndexerBlockSizes:
  """Prefill (many row tiles): fused top-k, 2 stages so two CTAs share an SM.

  Decode (few row tiles): block scores to HBM with the key blocks split over enough CTAs to fill the
  GPU twice, at least 4 blocks per CTA, and a deeper pipeline (the op is bandwidth-bound there).
  """
  ctas = batch * num_row_tiles
  if ctas >= num_sms:
    return IndexerBlockSizes(kv_stages=2, num_splits=1, fused_topk=True)
  want = -(-2 * num_sms // ctas)
  splits = max(1, min(want, num_blocks // 4))
  return IndexerBlockSizes(kv_stages=4, num_splits=splits, fused_topk=False)
