"""Splitting parameters into pieces that are built (and written) one at a time.

A piece is rows [start, stop) of one parameter's leading axis, built from source tensors by one TensorRule.
Every parameter is one piece except stacked experts ([E, H, 2I] / [E, I, H]), which are split into groups of
experts of at most ``max_bytes`` each: for full M3 in bf16 one layer's gate_up is 128 * 6144 * 6144 * 2 B =
9.7 GB, so conversion memory is bounded by the largest non-expert array (the 2.5 GB embedding / LM head).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from m3jax.checkpoint.mapping import TensorRule, expert_subrule, num_stacked_experts


class Reader(Protocol):
  def get(self, name: str, rows: slice | None = None) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Piece:
  """Rows [start, stop) of a parameter, built by ``rule`` from its sources (``rows`` of each, if not None)."""

  start: int
  stop: int
  rule: TensorRule
  rows: slice | None = None

  def build(self, reader: Reader) -> np.ndarray:
    """Reads the sources and returns param[start:stop] (source dtype; the caller casts)."""
    return self.rule.to_param([reader.get(name, self.rows) if self.rows is not None else reader.get(name)
                               for name in self.rule.sources])

  def split(self, param_rows: np.ndarray) -> list[np.ndarray]:
    """Inverse of build: param[start:stop] -> the source tensors (or their ``rows``), in ``rule.sources`` order."""
    return self.rule.from_param(param_rows)


def split_rule(rule: TensorRule, shape: tuple[int, ...], itemsize: int, max_bytes: int) -> list[Piece]:
  """The pieces of a parameter of ``shape`` built by ``rule``: one piece unless it is a stacked-expert parameter
  larger than ``max_bytes``, which is cut into expert groups of at most ``max_bytes`` (at least one expert)."""
  experts = num_stacked_experts(rule)
  total = int(np.prod(shape, dtype=np.int64)) * itemsize
  if not experts or total <= max_bytes:
    return [Piece(0, shape[0] if shape else 0, rule)]
  per_expert = total // experts
  group = max(1, max_bytes // per_expert)
  pieces = []
  for start in range(0, experts, group):
    stop = min(start + group, experts)
    sub, rows = expert_subrule(rule, start, stop)
    pieces.append(Piece(start, stop, sub, rows))
  return pieces
