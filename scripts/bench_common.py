"""Helpers shared by the benchmark scripts (importable because a script's own folder is on sys.path)."""

from __future__ import annotations

import statistics
import time

import jax


def timed_ms(fn, *args, repeats: int) -> float:
  """Median wall time (ms) of fn(*args), each call synchronised, after one warm-up call (which compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)
