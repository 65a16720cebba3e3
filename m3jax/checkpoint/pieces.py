"""Splitting parameters into pieces that are built (and written) one at a time.

A piece is a region of one parameter (slices per axis), built from source tensors (or row ranges of them) and
split back into them for export. Parameters larger than ``max_bytes`` are cut:
  * stacked experts ([E, H, 2I] / [E, I, H]) into groups of experts (full M3 in bf16: one layer's gate_up is
    128 * 6144 * 6144 * 2 B = 9.7 GB);
  * the embedding [V, H] into row ranges (= source row ranges) and the LM head [H, V] into column ranges
    (= source [V, H] row ranges, transposed), 2.5 GB each at full size;
every other parameter (at most ~300 MB for full M3) is one piece. Conversion memory is then bounded by the
piece size, not by the largest array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np

from m3jax.checkpoint import fp8_params
from m3jax.checkpoint.fastops import apply_layout, transpose_last2
from m3jax.checkpoint.mapping import TensorRule, expert_subrule, num_stacked_experts
from m3jax.layers.quantized import QuantSpec

Index = tuple[slice, ...]


class Reader(Protocol):
  def get(self, name: str, rows: slice | None = None) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Piece:
  """Region ``index`` of a parameter.

  build(reader) -> param[index] (source dtype; the caller casts), from the tensors in ``names``.
  split(param[index]) -> one array per entry of ``names``: the tensor, or its leading-axis rows ``rows`` when
  the piece covers only part of it.
  """

  index: Index
  names: tuple[str, ...]
  build: Callable[[Reader], np.ndarray]
  split: Callable[[np.ndarray], list[np.ndarray]]
  rows: slice | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in self.index)


def _full(shape: tuple[int, ...]) -> Index:
  return tuple(slice(0, n) for n in shape)


def whole(rule: TensorRule, shape: tuple[int, ...]) -> Piece:
  """The whole parameter as one piece."""
  return Piece(_full(shape), tuple(rule.sources),
               lambda r: apply_layout(rule.to_param, [r.get(n) for n in rule.sources]), _inverse(rule))


def _inverse(rule: TensorRule) -> Callable[[np.ndarray], list[np.ndarray]]:
  return lambda param: apply_layout(lambda arrays: rule.from_param(arrays[0]), [param])


def split_rule(rule: TensorRule, shape: tuple[int, ...], itemsize: int, max_bytes: int) -> list[Piece]:
  """The pieces of a parameter of ``shape`` built by ``rule`` (see the module docstring)."""
  total = int(np.prod(shape, dtype=np.int64)) * itemsize
  if total <= max_bytes or not shape:
    return [whole(rule, shape)]
  experts = num_stacked_experts(rule)
  if experts:
    return _expert_pieces(rule, shape, experts, max_bytes // max(total // experts, 1))
  single_2d = len(rule.sources) == 1 and len(shape) == 2 and len(rule.source_shapes[0]) == 2
  if single_2d and rule.path == ("embed",) and rule.source_shapes[0] == shape:
    return _row_pieces(rule.sources[0], shape, max_bytes // (shape[1] * itemsize))
  if single_2d and rule.path == ("lm_head",) and rule.source_shapes[0] == shape[::-1]:
    return _column_pieces(rule.sources[0], shape, max_bytes // (shape[0] * itemsize))
  return [whole(rule, shape)]


def split_fp8(rule: TensorRule, part: str, spec: QuantSpec, shape: tuple[int, ...], itemsize: int,
              max_bytes: int) -> list[Piece]:
  """The pieces of the ``part`` ('values' | 'scales') of ``rule``'s parameter kept in fp8 (fp8_params.build /
  split; readers are ``fp8_params.Fp8Reader``s): whole, or groups of experts for a stacked-expert parameter."""
  total = int(np.prod(shape, dtype=np.int64)) * itemsize
  experts = num_stacked_experts(rule)
  if total <= max_bytes or not experts:
    return [Piece(_full(shape), tuple(rule.sources), lambda r: fp8_params.build(rule, part, r, spec),
                  lambda a: fp8_params.split(rule, part, a, spec))]
  group = max(max_bytes // max(total // experts, 1), 1)
  pieces = []
  for start in range(0, experts, group):
    stop = min(start + group, experts)
    sub, rows = expert_subrule(rule, start, stop)
    pieces.append(Piece((slice(start, stop),) + _full(shape[1:]), tuple(sub.sources),
                        lambda r, sub=sub, rows=rows: fp8_params.build(sub, part, r, spec, rows),
                        lambda a, sub=sub: fp8_params.split(sub, part, a, spec), rows))
  return pieces


def _expert_pieces(rule: TensorRule, shape: tuple[int, ...], experts: int, group: int) -> list[Piece]:
  group = max(group, 1)
  pieces = []
  for start in range(0, experts, group):
    stop = min(start + group, experts)
    sub, rows = expert_subrule(rule, start, stop)

    def build(r: Reader, sub=sub, rows=rows) -> np.ndarray:
      return apply_layout(sub.to_param, [r.get(n, rows) if rows is not None else r.get(n) for n in sub.sources])

    pieces.append(Piece((slice(start, stop),) + _full(shape[1:]), tuple(sub.sources), build, _inverse(sub), rows))
  return pieces


def _row_pieces(name: str, shape: tuple[int, int], rows_per: int) -> list[Piece]:
  """param [V, H] = source [V, H]: piece = source rows."""
  rows_per = max(rows_per, 1)
  pieces = []
  for start in range(0, shape[0], rows_per):
    rows = slice(start, min(start + rows_per, shape[0]))
    pieces.append(Piece((rows, slice(0, shape[1])), (name,), lambda r, rows=rows: r.get(name, rows),
                        lambda a: [a], rows))
  return pieces


def _column_pieces(name: str, shape: tuple[int, int], cols_per: int) -> list[Piece]:
  """param [H, V] = source [V, H].T: piece = param columns = source rows, transposed."""
  cols_per = max(cols_per, 1)
  pieces = []
  for start in range(0, shape[1], cols_per):
    rows = slice(start, min(start + cols_per, shape[1]))
    pieces.append(Piece((slice(0, shape[0]), rows), (name,),
                        lambda r, rows=rows: transpose_last2(r.get(name, rows)),
                        lambda a: [transpose_last2(a)], rows))
  return pieces
