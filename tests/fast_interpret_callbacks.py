"""A faster host side for the io_callbacks of Pallas' GPU interpret mode, for the tests on CPU.

The Mosaic GPU interpreter (``plgpu.InterpretGPUParams``) simulates every load, store, barrier and TMA copy
of a kernel through ``jax.experimental.io_callback``: a 300-token forward of the kernel-ready test model makes
~25,000 of them. jax 0.11.2 hands each callback its operands (numpy arrays from XLA, ~11 per call: indices,
tokens, values) through the general ``jax.device_put``, whose Python dispatch costs ~120 us per operand; that
was ~75 % of the interpreted forward (cProfile: 33.7 s of 44.4 s in ``device_put``).

``install()`` replaces ``jax._src.callback.io_callback_impl`` with one that builds the same committed
single-device CPU arrays through ``xla_client.batched_device_put`` directly, the call ``device_put`` ends in
(cached avals, no dispatch): the 300-token forward ran in 12 s instead of 22 s, with bit-identical logits.
Operands that are not plain numpy arrays of a canonical dtype (never seen from XLA, but possible in principle)
still go through ``jax.device_put``. Everything else is the original function: the CPU device lookup and its
error, ``config.default_device``, the results converted with ``np.asarray``, and exceptions logged and raised.

The replacement is tied to the source it was written against: ``enable()`` leaves jax untouched (and says
why) if the jax version or the original function's source differ. ``install()`` enables it on CPU runs
(``JAX_PLATFORMS=cpu``) unless ``M3JAX_TEST_FAST_INTERPRET=0``. ``tests/kernels/test_fast_interpret_callbacks.py``
checks kernels give bit-identical outputs both ways.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import warnings

import jax
import numpy as np
from jax._src import callback as _callback
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import tree_util as _tree_util
from jax._src import xla_bridge as _xb
from jax._src.lib import xla_client as _xc
from jax._src.sharding_impls import SingleDeviceSharding

JAX_VERSION = "0.11.2"
# sha256 of inspect.getsource(jax._src.callback.io_callback_impl) in jax 0.11.2, the function replaced here.
ORIGINAL_SOURCE_SHA256 = "3396b676250803d9cf83d69ca8d38069575992d36644ad8799f9c0aa3afb40ee"
ORIGINAL = _callback.io_callback_impl
_logger = logging.getLogger("jax._src.callback")
_aval = functools.cache(_core.ShapedArray)  # (shape, dtype) -> aval
_single_device_sharding = functools.cache(SingleDeviceSharding)


def _on_cpu(x, cpu_device):
  """``jax.device_put(x, cpu_device)`` for a numpy array of a canonical dtype, without jax's dispatch."""
  if type(x) is not np.ndarray or x.dtype != _dtypes.canonicalize_dtype(x.dtype) or x.dtype == _dtypes.float0:
    return jax.device_put(x, cpu_device)
  return _xc.batched_device_put(_aval(x.shape, x.dtype), _single_device_sharding(cpu_device), [x], [cpu_device],
                                True)


def fast_io_callback_impl(*args, result_avals, callback, sharding, ordered):
  """``jax._src.callback.io_callback_impl`` with its operands put on the CPU device directly (see module)."""
  del result_avals, sharding, ordered
  try:
    cpu_device, *_ = _xb.local_devices(backend="cpu")
  except RuntimeError as e:
    raise RuntimeError(
        "jax.io_callback failed to find a local CPU device to place the inputs on. Make sure \"cpu\" is listed "
        "in --jax_platforms or the JAX_PLATFORMS environment variable.") from e
  args = tuple(_on_cpu(x, cpu_device) for x in args)
  with _config.default_device(cpu_device):
    try:
      return _tree_util.tree_map(np.asarray, callback(*args))
    except BaseException:
      _logger.exception("jax.io_callback failed")
      raise


def original_source_sha256() -> str:
  return hashlib.sha256(inspect.getsource(ORIGINAL).encode()).hexdigest()


def why_not_installable() -> str | None:
  """None if ``enable()`` can replace the original; else the reason it leaves jax untouched."""
  if jax.__version__ != JAX_VERSION:
    return f"jax {jax.__version__} is not {JAX_VERSION}, the version the replacement was written against"
  if original_source_sha256() != ORIGINAL_SOURCE_SHA256:
    return "jax._src.callback.io_callback_impl's source is not the one the replacement was written against"
  return None


def install() -> bool:
  """``enable()`` on CPU runs (``JAX_PLATFORMS=cpu``) unless ``M3JAX_TEST_FAST_INTERPRET=0``; returns whether it
  did. What conftest and the script subprocesses' sitecustomize call."""
  if os.environ.get("JAX_PLATFORMS") != "cpu" or os.environ.get("M3JAX_TEST_FAST_INTERPRET", "1") == "0":
    return False
  return enable()


def enable() -> bool:
  """Replaces ``io_callback_impl`` (see module); returns whether it did. Idempotent."""
  reason = why_not_installable()
  if reason is not None:
    warnings.warn(f"interpret-mode callbacks keep jax's own io_callback_impl: {reason}", stacklevel=2)
    return False
  _callback.io_callback_impl = fast_io_callback_impl
  return True


def installed() -> bool:
  return _callback.io_callback_impl is fast_io_callback_impl


def uninstall() -> None:
  _callback.io_callback_impl = ORIGINAL
