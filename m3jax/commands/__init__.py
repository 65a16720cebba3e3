"""Subcommands of the ``m3jax`` CLI (see m3jax/cli.py)."""
