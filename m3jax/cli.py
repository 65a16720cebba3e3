"""The ``m3jax`` command line. Each subcommand lives in ``m3jax/commands/<name>.py`` and exposes
``add_parser(subparsers)`` (registering its arguments and ``func``).

Errors a user can cause or fix (bad arguments or inputs, a malformed checkpoint, a read-only output directory, a
port in use, Ctrl-C / SIGTERM) end the command with one line on stderr, ``m3jax COMMAND: error: ...``, and exit
code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from m3jax.commands import CommandFailed
from m3jax.interrupts import Terminated, terminate_raises

# Subcommand modules, in the order `m3jax --help` lists them.
COMMANDS = ("demo", "generate", "batch", "chat", "serve", "score", "forward", "convert", "inspect", "export", "train")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="m3jax", description="MiniMax M3 in JAX: run, convert and inspect.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name in COMMANDS:
    importlib.import_module(f"m3jax.commands.{name}").add_parser(sub)
  return parser


def error_line(e: BaseException) -> str:
  """An exception as one line: an OSError as 'path: reason', anything else as its message, newlines folded."""
  if isinstance(e, KeyboardInterrupt):
    return f"interrupted ({signal.Signals.SIGINT.name})"
  if isinstance(e, Terminated):
    return f"interrupted ({signal.Signals.SIGTERM.name})"
  if isinstance(e, OSError) and e.strerror:
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    text = f"{where}: {e.strerror}" if where else e.strerror
  else:
    text = str(e) or type(e).__name__
  return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    with terminate_raises():
      return int(args.func(args) or 0)
  except (ValueError, OSError, CommandFailed, KeyboardInterrupt, Terminated) as e:  # one clear line, no traceback
    print(f"m3jax {args.command}: error: {error_line(e)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
