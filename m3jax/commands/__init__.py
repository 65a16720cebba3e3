"""The ``m3jax`` subcommands (one module each; see m3jax/cli.py)."""


class CommandFailed(Exception):
  """A command that ran but could not do all it was asked (e.g. some prompts of a batch failed); m3jax.cli reports
  the message as one line with exit code 2."""
