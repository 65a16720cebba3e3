"""Logical axis names carried by every parameter and cache leaf (mapped to mesh axes by the sharding rules).

Parameters are created with ``nnx.Param(value, out_sharding=(names...), eager_sharding=False)`` so the
names travel as metadata without forcing a mesh at construction time.
"""

VOCAB = "vocab"
EMBED = "embed"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
EXPERTS = "experts"
EXPERT_MLP = "expert_mlp"
IDX_HEADS = "index_heads"
IDX_DIM = "index_dim"
NORM = "norm"

CACHE_BATCH = "cache_batch"
CACHE_SEQ = "cache_seq"
CACHE_HEADS = "cache_kv_heads"
CACHE_DIM = "cache_head_dim"
