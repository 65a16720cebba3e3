"""Training metrics as JSON lines (one object per logged train step or evaluation), resumable."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def to_json(value: Any) -> Any:
  """Arrays and numpy scalars -> plain floats / nested lists (rounded to 6 significant digits)."""
  arr = np.asarray(value)
  if arr.ndim == 0:
    return float(f"{float(arr):.6g}")
  return [to_json(v) for v in arr]


class MetricsLog:
  """Appends records to ``path``; ``truncate_after(step)`` drops records of steps a resumed run will redo."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)

  def truncate_after(self, step: int) -> None:
    """Keeps only records with ``step`` <= ``step`` (rewritten through a temporary file, then renamed)."""
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps({k: (v if isinstance(v, (str, int)) else to_json(v)) for k, v in record.items()}) + "\n")
      f.flush()

  def read(self) -> list[dict[str, Any]]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]
