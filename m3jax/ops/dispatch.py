"""Kernel selection: ``M3JAX_KERNELS=reference|pallas|auto`` (default auto).

* reference: always the pure-jnp references in ``pallas_kernels.*.reference``.
* pallas: the Mosaic GPU kernels; on a machine without a GPU they run in interpret mode (slow, for tests).
* auto: the kernel on GPU when one exists for the op, the reference otherwise.

The choice is resolved when a model is built (``resolve_kernels``) and stored on the layers as a plain
string, so jit caches stay correct. A kernel that does not support a shape raises NotImplementedError; the
call then falls back to the reference (a rule, logged once per op and reason), never a silently wrong result.
So does ``pallas`` without a GPU under a multi-device sharding plan: the Mosaic GPU interpreter simulates one
GPU per process and cannot run kernels of several (simulated CPU) devices at once.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any, Literal

import jax

KernelChoice = Literal["reference", "pallas", "auto"]
_VALID = ("reference", "pallas", "auto")
_log = logging.getLogger("m3jax.ops")


def resolve_kernels(choice: str | None = None) -> KernelChoice:
  """The explicit choice, else $M3JAX_KERNELS, else 'auto'; validated."""
  value = choice if choice is not None else os.environ.get("M3JAX_KERNELS", "auto")
  value = value.strip().lower()
  if value not in _VALID:
    raise ValueError(f"M3JAX_KERNELS / kernels={value!r}: expected one of {_VALID}")
  return value  # type: ignore[return-value]


def _find_kernel(module: str, name: str) -> Callable[..., Any] | None:
  try:
    return getattr(importlib.import_module(module), name, None)
  except ImportError:
    return None


def _interpret_params() -> Any:
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  return plgpu.InterpretGPUParams()


def run_op(
    choice: KernelChoice,
    *,
    kernel_module: str,
    kernel_name: str,
    reference: Callable[..., jax.Array],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kernel_kwargs: dict[str, Any] | None = None,
) -> Any:
  """Runs ``kernel_module.kernel_name(*args, **kwargs, **kernel_kwargs, interpret=...)`` or
  ``reference(*args, **kwargs)``. ``kernel_kwargs``: kernel-only inputs that do not change the result (operands
  prepared once for many calls, e.g. ``pallas_kernels.moe.prepare_expert_weights``); the reference ignores them."""
  if choice == "reference":
    return reference(*args, **kwargs)
  on_gpu = _on_gpu()
  kernel = _find_kernel(kernel_module, kernel_name)
  if kernel is None:
    if choice == "pallas":
      _log_once(f"{kernel_module}.{kernel_name}: no Pallas kernel yet; using the reference")
    return reference(*args, **kwargs)
  if choice == "auto" and not on_gpu:
    return reference(*args, **kwargs)
  if not on_gpu and _multi_device_plan():
    _log_once(f"{kernel_module}.{kernel_name}: the GPU interpreter cannot run kernels on several devices at "
              "once; using the reference")
    return reference(*args, **kwargs)
  interpret = False if on_gpu else _interpret_params()
  try:
    return kernel(*args, **kwargs, **(kernel_kwargs or {}), interpret=interpret)
  except NotImplementedError as e:
    _log_once(f"{kernel_module}.{kernel_name}: falls back to the reference: {e}")
    return reference(*args, **kwargs)


def runs_kernel(choice: KernelChoice) -> bool:
  """Whether ``run_op`` with this choice calls a kernel (compiled or interpreted) in the current context, before
  any shape-based fallback: what inputs prepared only for kernels are worth building for."""
  if choice == "reference" or (choice == "auto" and not _on_gpu()):
    return False
  return _on_gpu() or not _multi_device_plan()


def _on_gpu() -> bool:
  """Whether kernels run compiled (a GPU backend) rather than in the GPU interpreter."""
  return jax.default_backend() == "gpu"


def _multi_device_plan() -> bool:
  from m3jax import sharding  # pylint: disable=g-import-not-at-top

  plan = sharding.current_plan()
  return plan is not None and not plan.is_trivial


_seen: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _seen:
    _seen.add(message)
    _log.warning(message)
