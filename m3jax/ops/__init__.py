"""The only place that chooses between a Pallas kernel and the pure-jnp reference for the heavy ops."""
