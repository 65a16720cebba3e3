"""Helpers shared by the benchmark scripts (importable because a script's own folder is on sys.path)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


# Set by a script's CPU dry run (kernels in the GPU interpreter, whose times mean nothing): every measurement below
# is one synchronised call, without a warm-up call before it. The call still checks the code path and its output.
DRY_RUN = False


def timed_ms(fn, *args, repeats: int) -> float:
  """Median wall time (ms) of fn(*args), each call synchronised, after one warm-up call (which compiles); one
  call, no warm-up, under ``DRY_RUN``."""
  if DRY_RUN:
    repeats = 1
  else:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def gpu_ms(fn, *args, iters=5):
  """(output, median GPU ms, timer) of fn(*args): CUPTI kernel time (launch gaps excluded) if jax's Mosaic
  GPU profiler can measure it, else the median wall clock of synchronised calls (one call, no warm-up, under
  ``DRY_RUN``)."""
  if DRY_RUN:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, (time.perf_counter() - t0) * 1e3, "wall"
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


def copy_tbps(nbytes: int = 1 << 31, reps: int = 10, rounds: int = 3) -> float:
  """The device's copy bandwidth in TB/s, the decode roofline's denominator: ``y = x + 1`` over a bf16 array of
  ``nbytes`` (bytes read + written), the median over ``rounds`` of ``reps`` back-to-back calls (after a warm-up
  round, which also brings the GPU to working clocks). Run it before the model is allocated: it holds 2 x nbytes."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a + jnp.bfloat16(1))
  jax.block_until_ready(f(x))
  times = []
  for _ in range(rounds + 1):
    start = time.perf_counter()
    for _ in range(reps):
      y = f(x)
    jax.block_until_ready(y)
    times.append((time.perf_counter() - start) / reps)
  del x, y
  return 2 * nbytes / statistics.median(times[1:]) / 1e12
