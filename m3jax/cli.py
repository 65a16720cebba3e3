"""The ``m3jax`` command line. Each subcommand lives in ``m3jax/commands/<name>.py`` and exposes
``add_parser(subparsers)`` (registering its arguments and ``func``)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `m3jax --help` lists them.
COMMANDS = ("demo", "generate", "batch", "chat", "serve", "score", "forward", "convert", "inspect", "export", "train")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="m3jax", description="MiniMax M3 in JAX: run, convert and inspect.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name in COMMANDS:
    importlib.import_module(f"m3jax.commands.{name}").add_parser(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return int(args.func(args) or 0)
  except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
    print(f"m3jax {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
