"""Gives the benchmark-script subprocesses of tests/test_bench_scripts.py (on CPU, kernels in interpret mode) the
tests' faster host side for interpret mode's callbacks (tests/fast_interpret_callbacks.py). Python imports this
module at start-up because ``run_script`` puts this directory on PYTHONPATH; nothing else does."""

import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
import fast_interpret_callbacks  # noqa: E402  pylint: disable=g-import-not-at-top

fast_interpret_callbacks.install()  # on CPU, unless M3JAX_TEST_FAST_INTERPRET=0
