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
  through the environment, before jax is imported, so the subprocesses tests start inherit it, and so do the
  pytest-xdist workers: the controller process sets it before it starts them, so they share one directory
  (``tests/main``; a clean-clone CI run leaves ~5,500 entries, 155 MB). jax writes an entry without a lock when
  eviction is off; a worker that read one half written would get a decompression error, which jax reports as a
  warning before compiling the program itself (none in the CI logs). Under the checkout's git-ignored
  ``.jax_cache/``; a fresh clone starts empty. ``M3JAX_TEST_COMPILATION_CACHE=0`` turns it off, ``=<dir>`` puts
  it elsewhere."""
  setting = os.environ.get("M3JAX_TEST_COMPILATION_CACHE", "")
  if setting == "0":
    return
  root = pathlib.Path(setting) if setting else pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "tests" / "main"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _compile_without_llvm_optimisation() -> None:
  """Asks XLA:CPU for LLVM optimisation level ``M3JAX_TEST_XLA_OPT_LEVEL`` (default 0;
  ``=default`` keeps XLA's own) through ``--xla_backend_optimization_level``, unless ``XLA_FLAGS`` already
  names a level or the tests run on a GPU (``JAX_PLATFORMS`` other than cpu: the compiled GPU runs keep XLA's
  default). The suite's programs are tiny, so most of CI is XLA:CPU compiling them, not running them: a clean-
  clone CI run took 1736 s at XLA's default level and 1530 s at level 0, back to back on one machine (479
  passed either way). Same HLO and the same fp32 semantics (no fast-math at any level), so the same
  assertions hold. Set through the environment before jax is imported, so the CLI, notebook and worker
  subprocesses the tests start inherit it."""
  flags = os.environ.get("XLA_FLAGS", "")
  level = os.environ.get("M3JAX_TEST_XLA_OPT_LEVEL", "0")
  if os.environ["JAX_PLATFORMS"] != "cpu" or level == "default" or "xla_backend_optimization_level" in flags:
    return
  if level not in ("0", "1", "2", "3"):
    raise ValueError(f"M3JAX_TEST_XLA_OPT_LEVEL must be 0-3 or 'default', got {level!r}")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level={level}".strip()


def _share_the_gpu_between_workers() -> None:
  """On a GPU, several pytest-xdist workers share one device: by default each jax process preallocates 75 % of
  its memory, so a second worker's first kernel fails with CUDA out-of-memory (seen with ``-n 4`` on an H100:
  4 of 41 kernel tests failed). Workers allocate on demand instead, unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` or
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is already set. Before jax is imported, like the settings above."""
  if os.environ.get("PYTEST_XDIST_WORKER") and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


_use_persistent_compilation_cache()
_compile_without_llvm_optimisation()
_share_the_gpu_between_workers()

import fast_interpret_callbacks  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
fast_interpret_callbacks.install()  # CPU runs: a faster host side for the kernels' interpret mode

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
  """Runs the tests marked ``slow`` (half a minute to a few minutes each on a quiet 2-core machine) first.
  With pytest-xdist handing out one test at a time (``--maxschedchunk 1`` in scripts/test.sh), the workers
  start the long tests early and fill in with the short ones, instead of a multi-minute test starting late and
  keeping one worker busy after the other has finished. Order only: nothing is skipped."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: otherwise collection order
