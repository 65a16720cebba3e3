"""Dense causal and block-sparse attention (GQA)."""
from pallas_kernels.attention.reference import causal_attention_reference, sparse_attention_reference

__all__ = ["causal_attention_reference", "sparse_attention_reference"]
