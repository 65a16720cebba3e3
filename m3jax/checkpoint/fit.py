"""Whether a model's weights fit its devices, checked from the abstract model before a byte is read.

Loading full M3 (~850 GB of bf16 weights) onto too few devices would otherwise fail with an allocator error
minutes into the read; this names the sizes up front. Only the weights are counted (the caches and activations
come on top), so a load that passes may still run short later, but one that fails here cannot succeed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from m3jax.checkpoint.fsutil import format_bytes
from m3jax.checkpoint.safetensors_dir import CheckpointError

ParamPath = tuple[Any, ...]


def device_limit(device: jax.Device) -> int | None:
  """Bytes the device's allocator may use, or None where the backend does not say (CPU) or the device belongs to
  another process (multi-process runs: each process checks its own devices)."""
  if device.process_index != jax.process_index():
    return None
  stats = device.memory_stats()
  return None if not stats else stats.get("bytes_limit")


def weights_per_device(flat: Sequence[tuple[ParamPath, Any]], placement: Callable[[ParamPath], Any]
                       ) -> dict[jax.Device, int]:
  """Bytes of parameters each device will hold: [(path, abstract var)] laid out by placement(path) (a Sharding;
  None = the default device)."""
  held: dict[jax.Device, int] = defaultdict(int)
  for param_path, var in flat:
    sharding = placement(param_path)
    itemsize = np.dtype(var.dtype).itemsize
    if sharding is None:
      held[jax.devices()[0]] += math.prod(var.shape) * itemsize
      continue
    shard_bytes = math.prod(sharding.shard_shape(tuple(var.shape))) * itemsize
    for device in sharding.device_set:
      held[device] += shard_bytes
  return dict(held)


def check_weights_fit(path: str, flat: Sequence[tuple[ParamPath, Any]], placement: Callable[[ParamPath], Any]
                      ) -> None:
  """Raises CheckpointError naming the checkpoint, the device and both sizes when a device's share of the
  weights exceeds its memory (``device_limit``)."""
  held = weights_per_device(flat, placement)
  for device, need in sorted(held.items(), key=lambda kv: -kv[1]):
    limit = device_limit(device)
    if limit is not None and need > limit:
      raise CheckpointError(
          f"{path}: the weights alone need {format_bytes(need).strip()} on {device} ({len(held)} device(s) "
          f"hold weights, {format_bytes(sum(held.values())).strip()} in all) but it has "
          f"{format_bytes(limit).strip()}: load onto a mesh over more devices (m3jax.load(path, mesh=...) / --mesh, "
          "e.g. expert=8), or keep a quantized checkpoint's weights in fp8 (keep_quantized=True / --keep-quantized)")
