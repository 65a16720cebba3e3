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


def _use_persistent_compilation_cache() -> None:
  """Keeps compiled XLA programs on disk, so that a program compiled again (by a later test or module after
  ``_release`` emptied jax's in-memory caches, by a CLI / notebook / script subprocess, or by a later run) is
  read back instead of rebuilt: outside interpret mode most of the suite's time is XLA:CPU compilation. Set
  through the environment, before jax is imported, so the subprocesses tests start inherit it. One directory
  per pytest-xdist worker (jax writes cache files without a lock unless eviction is on), under the checkout's
  git-ignored ``.jax_cache/``; a fresh clone starts empty. ``M3JAX_TEST_COMPILATION_CACHE=0`` turns it off,
  ``=<dir>`` puts it elsewhere."""
  setting = os.environ.get("M3JAX_TEST_COMPILATION_CACHE", "")
  if setting == "0":
    return
  root = pathlib.Path(setting) if setting else pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "tests" / worker))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _compile_without_llvm_optimisation() -> None:
  """Asks XLA:CPU for its lowest LLVM optimisation level (``--xla_backend_optimization_level=0``) unless
  ``XLA_FLAGS`` already names a level. The suite's programs are tiny: most of its time is XLA:CPU compiling
  them, not running them, and level 0 compiles them ~25-30 % faster (tests/test_model.py's cached-vs-full
  forward 23.6-24.7 s -> 16.9-18.6 s; the indexer and attention kernel tests in interpret mode 75.8 -> 58.4 s).
  Same HLO, same fp32 semantics (no fast-math at any level), so the same assertions hold; what ships runs on
  the GPU, where this flag does nothing. Set through the environment before jax is imported, so the CLI,
  notebook and worker subprocesses the tests start inherit it. ``M3JAX_TEST_XLA_OPTIMIZE=1`` keeps XLA's
  default level."""
  flags = os.environ.get("XLA_FLAGS", "")
  if os.environ.get("M3JAX_TEST_XLA_OPTIMIZE", "0") == "1" or "xla_backend_optimization_level" in flags:
    return
  os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


_use_persistent_compilation_cache()
_compile_without_llvm_optimisation()

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


def pytest_collection_modifyitems(config, items):
  """Runs the tests marked ``slow`` (one to six minutes each on a 2-core machine) first. With pytest-xdist
  handing out one test at a time (``--maxschedchunk 1`` in scripts/test.sh), the workers start the long tests
  early and fill in with the short ones, instead of a multi-minute test starting late and keeping one worker
  busy after the other has finished. Order only: nothing is skipped."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: otherwise collection order
