"""Sharded implementations of the heavy ops (shard_map), used by m3jax.ops when a multi-device plan is active:
head / query-token parallel attention and indexer (heads.py), expert-parallel MoE (moe.py), per-device memory
planning (memory.py)."""
