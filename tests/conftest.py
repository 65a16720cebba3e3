"""Shared test configuration: CPU only, fp32 matmuls at full precision, fixture paths.

Every compiled XLA:CPU executable keeps its JIT code in ~3 memory mappings per kernel, and jax's
caches keep every executable alive. One long-lived pytest-xdist worker running half the suite
crossed the kernel's `vm.max_map_count` (65530) and LLVM aborted mid-compile ("Fatal Python error:
Aborted", a different test each time). `_release_compiled_programs` empties jax's caches after each
test module (test_generate alone leaves ~20k mappings; after clearing, ~700), and after any test that
leaves the process above `_MAPPINGS_BEFORE_CLEARING`, so that no single module can reach the limit.
"""

import gc
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
_MAPPINGS_BEFORE_CLEARING = 30_000  # of the kernel's default vm.max_map_count, 65530


def _memory_mappings() -> int:
  """Number of memory mappings of this process (0 where /proc is not available)."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


def _release() -> None:
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def fixtures_dir() -> pathlib.Path:
  return FIXTURES


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Frees the module's compiled executables (and their JIT code mappings) when it finishes."""
  yield
  _release()


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
  """Frees compiled executables after a test once the process holds too many mappings."""
  yield
  if _memory_mappings() > _MAPPINGS_BEFORE_CLEARING:
    _release()
