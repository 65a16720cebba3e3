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

# Activations (constrained through m3jax.sharding.constrain; never given as PartitionSpecs in layers).
ACT_BATCH = "act_batch"
ACT_VISION_SEGMENTS = "act_vision_segments"  # packed image / video segments of the vision tower (data parallel)
ACT_SEQ = "act_seq"  # residual-stream tokens between layers (sharded only under sequence parallelism)
ACT_Q_SEQ = "act_q_seq"  # query tokens inside attention / the indexer (keys always span the whole cache)
ACT_HEADS = "act_heads"  # attention / indexer heads (after KV / index-head replication)
ACT_EMBED = "act_embed"
ACT_VOCAB = "act_vocab"
