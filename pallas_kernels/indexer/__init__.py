"""Lightning indexer: block scores and top-k block selection."""
from pallas_kernels.indexer.api import indexer_topk
from pallas_kernels.indexer.config import IndexerBlockSizes, heuristic_block_sizes
from pallas_kernels.indexer.reference import (
    index_block_scores_reference,
    indexer_topk_reference,
    select_blocks_reference,
)

__all__ = [
    "IndexerBlockSizes",
    "heuristic_block_sizes",
    "index_block_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "select_blocks_reference",
]
