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


def gpu_ms(fn, *args, iters=5):
  """(output, median GPU ms, timer) of fn(*args): CUPTI kernel time (launch gaps excluded) if jax's Mosaic
  GPU profiler can measure it, else the median wall clock of synchronised calls."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    out, times = profiler.measure(fn, iterations=iters)(*args)
    times = times if isinstance(times, list) else [times]
    return out, statistics.median(times), "cupti"
  except Exception:  # noqa: BLE001 - fall back to wall clock
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(times), "wall"
