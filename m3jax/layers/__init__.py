"""Flax NNX modules of the M3 text backbone (parameters and wiring; heavy maths goes through m3jax.ops)."""
