"""Lightning indexer: block scores and top-k block selection."""
from pallas_kernels.indexer.reference import (
    index_block_scores_reference,
    indexer_topk_reference,
    select_blocks_reference,
)

__all__ = ["index_block_scores_reference", "indexer_topk_reference", "select_blocks_reference"]
