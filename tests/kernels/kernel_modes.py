"""The two ways kernel tests run: Mosaic GPU interpret mode (CPU, always) and compiled on an sm90 GPU."""

import collections
import re

import jax
import pytest


def on_sm90() -> bool:
  """True on a Hopper (compute capability 9.0) GPU backend."""
  if jax.default_backend() != "gpu":
    return False
  return getattr(jax.devices()[0], "compute_capability", "") in ("9.0", "9.0a")


MODES = [
    pytest.param("interpret", marks=pytest.mark.interpret),
    pytest.param("gpu", marks=pytest.mark.skipif(not on_sm90(), reason="needs an sm90 GPU")),
]


def lowered_kernel_kinds(stablehlo_text: str) -> collections.Counter:
  """Mosaic GPU kernel modules of a program lowered for CUDA, by kind (attention / indexer / moe); a module
  called by several layers appears once."""
  names = re.findall(r"m3_(attention|indexer)\w*?_mosaic|(moe)_grouped_\w*?_mosaic", stablehlo_text)
  return collections.Counter(a or b for a, b in names)
