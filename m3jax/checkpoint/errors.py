"""The error every checkpoint reader raises (``m3jax.checkpoint.safetensors_dir`` re-exports it)."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as an M3 model (names the file and tensor)."""
