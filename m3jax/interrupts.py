"""SIGTERM handled like Ctrl-C by the ``m3jax`` commands: both raise an exception in the main thread, so that the
cleanups that run on errors (``fsutil.atomic_output_dir`` removing a partial output, a server closing) run on them
too, and ``m3jax.cli`` reports either as one line instead of a traceback."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(BaseException):
  """SIGTERM arrived (a BaseException like KeyboardInterrupt, so that ``except Exception`` does not swallow it)."""


def _raise_terminated(signum, frame) -> None:
  del signum, frame
  raise Terminated()


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
  """Within the block, SIGTERM raises Terminated in the main thread (SIGINT already raises KeyboardInterrupt).
  Outside the main thread (no signal handlers there) it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, _raise_terminated)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
  """Within the block, SIGINT and SIGTERM wait until it ends (a cleanup that a second Ctrl-C must not cut short);
  one that arrived meanwhile is then raised as usual. Outside the main thread it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  arrived: list[int] = []
  handlers = {s: signal.signal(s, lambda signum, frame: arrived.append(signum))
              for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, handler in handlers.items():
      signal.signal(s, handler)
    if arrived:
      handler = handlers[arrived[0]]
      if callable(handler):
        handler(arrived[0], None)
      elif handler == signal.SIG_DFL:
        signal.raise_signal(arrived[0])
