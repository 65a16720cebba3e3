"""Dense causal and block-sparse attention (GQA)."""
from pallas_kernels.attention.api import causal_attention, sparse_attention
from pallas_kernels.attention.config import KvMajorBlockSizes, SparseAttentionBlockSizes, heuristic_block_sizes
from pallas_kernels.attention.config import kv_major_block_sizes
from pallas_kernels.attention.reference import causal_attention_reference, sparse_attention_reference

__all__ = [
    "KvMajorBlockSizes",
    "SparseAttentionBlockSizes",
    "causal_attention",
    "causal_attention_reference",
    "heuristic_block_sizes",
    "kv_major_block_sizes",
    "sparse_attention",
    "sparse_attention_reference",
]
