"""Weights kept in fp8 (``m3jax.layers.quantized``) <-> checkpoint tensors, without a dequantized copy.

A kept parameter has two arrays, ``values`` (float8_e4m3fn [*batch, out, in], the checkpoint orientation) and
``scales``; both are assembled from the source tensors' own values / scales by the rule's ``fp8_groups``
(concatenated along ``out``, stacked over experts; fp8_block scale rows re-blocked where a part ends inside a row
block) and split back the same way for export. Sources come through a ``Fp8Reader``: a TensorSource (weights the
checkpoint stores in fp8) or a ``QuantizingReader`` (float weights quantized on the way, ``convert --quantize``).

Which parameters are kept: ``kept_specs`` (every linear weight whose sources are all fp8 of one format / block /
scale dtype; others are dequantized as before) or ``quantize_specs`` (every quantizable linear weight).

NVFP4 (``m3jax.load(..., keep_quantized=True)`` only; ``convert`` dequantizes it): the routed experts whose
per-expert tensors are all NVFP4 with one global scale each are kept packed, with a third part, ``global_scale``
(fp32 [E, P]: each source tensor's divisor inverted, the P = len(group) tensors of an expert in order; gate_up:
gate then up).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from m3jax.checkpoint import quantized as q
from m3jax.checkpoint.fastops import apply_layout
from m3jax.checkpoint.mapping import TensorRule
from m3jax.layers.quantized import ParamPath, QuantSpec, is_quantizable
from pallas_kernels.quant import concat_block, reblock_rows, unblock_rows

PARTS = ("values", "scales")
NVFP4_PARTS = ("values", "scales", "global_scale")
FP8_FORMATS = ("mxfp8", "fp8_block")
NVFP4_KEPT = ("w_gate_up", "w_down")  # nvfp4 stays packed for the routed experts only (the W4A16 MoE kernel)


def parts_of(spec: QuantSpec) -> tuple[str, ...]:
  """The parameters a kept weight has: values and scales (+ global_scale for nvfp4)."""
  return NVFP4_PARTS if spec.fmt == "nvfp4" else PARTS


class Fp8Reader(Protocol):
  def get_values(self, name: str, rows: slice | None = None) -> np.ndarray: ...

  def get_scales(self, name: str, rows: slice | None = None) -> np.ndarray: ...

  def get_global_scale(self, name: str, rows: slice | None = None) -> np.ndarray: ...  # nvfp4 only


def rule_spec(rule: TensorRule, fmt: str, source_block: tuple[int, int], scale_dtype: str) -> QuantSpec:
  """The spec of ``rule``'s parameter kept in ``fmt`` when its sources have ``source_block`` scales."""
  out_sizes = [rule.source_shapes[i][-2] for i in rule.fp8_groups[0]]
  if fmt == "nvfp4":
    return QuantSpec(fmt, tuple(source_block), scale_dtype, tuple(source_block), parts=len(rule.fp8_groups[0]))
  return QuantSpec(fmt, concat_block(out_sizes, fmt, source_block), scale_dtype, tuple(source_block))


def _keepable(rule: TensorRule) -> bool:
  return rule.fp8_groups is not None and is_quantizable(rule.path)


def kept_specs(rules: Iterable[TensorRule], source, formats: Sequence[str] = FP8_FORMATS
               ) -> dict[ParamPath, QuantSpec]:
  """Specs of the parameters a quantized checkpoint (a TensorSource) can keep quantized: linear weights whose
  sources are all mxfp8 or all fp8_block with one scale dtype, and (with "nvfp4" in ``formats``) routed experts
  whose per-expert sources are all nvfp4 with one global scale each. (A parameter mixing quantized and float
  sources, or E8M0 and float32 scales, is dequantized on load instead.)"""
  specs = {}
  for rule in rules:
    if not _keepable(rule):
      continue
    fmts = {source.quant_format(n) for n in rule.sources}
    fmt = fmts.pop() if len(fmts) == 1 else None
    if fmt not in formats:
      continue
    if fmt == "nvfp4" and not (str(rule.path[-1]) in NVFP4_KEPT and rule.fp8_stacked
                               and all(source.global_scale_size(n) == 1 for n in rule.sources)):
      continue
    scale_dtypes = {source.scale_dtype(n).name for n in rule.sources}
    if len(scale_dtypes) == 1:
      specs[rule.path] = rule_spec(rule, fmt, source.block(rule.sources[0]), scale_dtypes.pop())
  return specs


def quantize_specs(rules: Iterable[TensorRule], fmt: str = "mxfp8") -> dict[ParamPath, QuantSpec]:
  """Specs that quantize every quantizable linear weight of ``rules`` into ``fmt`` (``convert --quantize``)."""
  if fmt != "mxfp8":
    raise ValueError(f"quantizing into {fmt!r} is not supported (m3jax quantizes into mxfp8)")
  return {rule.path: rule_spec(rule, "mxfp8", (1, q.MX_BLOCK), "uint8") for rule in rules if _keepable(rule)}


def build(rule: TensorRule, part: str, reader: Fp8Reader, spec: QuantSpec, rows: slice | None = None) -> np.ndarray:
  """The ``part`` ('values' | 'scales' | nvfp4's 'global_scale') of ``rule``'s kept parameter from ``reader``
  (``rows``: the leading-axis rows of each source, for a group of experts of a stacked source)."""
  if part == "global_scale":  # one multiplier [1] per source: [P] per group, stacked [E, P]
    scales = [reader.get_global_scale(name, rows) for name in rule.sources]
    items = [np.concatenate([scales[i] for i in group]) for group in rule.fp8_groups]
    return np.stack(items) if rule.fp8_stacked else items[0]
  read = reader.get_values if part == "values" else reader.get_scales
  arrays = [read(name, rows) for name in rule.sources]

  def assemble(arrays: Sequence[np.ndarray]) -> np.ndarray:
    items = []
    for group in rule.fp8_groups:
      parts = []
      for i in group:
        a = arrays[i]
        if part == "scales" and spec.block != spec.source_block:
          a = reblock_rows(a, rule.source_shapes[i][-2], spec.source_block, spec.block[0])
        parts.append(a)
      items.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2))
    return np.stack(items) if rule.fp8_stacked else items[0]

  return apply_layout(assemble, arrays)  # fp8 values moved as uint8 (numpy's float8 copies are slow)


def split(rule: TensorRule, part: str, array: np.ndarray, spec: QuantSpec) -> list[np.ndarray]:
  """Inverse of ``build``: the ``part`` of each of ``rule``'s sources (scales in their own block)."""
  rows = spec.block[0] if part == "scales" else 1

  def separate(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None] * len(rule.sources)
    items = list(arrays[0]) if rule.fp8_stacked else [arrays[0]]
    for group, item in zip(rule.fp8_groups, items, strict=True):
      start = 0
      for i in group:
        o = rule.source_shapes[i][-2]
        n = -(-o // rows)
        a = item[..., start:start + n, :]
        if part == "scales" and spec.block != spec.source_block:
          a = unblock_rows(a, o, spec.block[0], spec.source_block)
        out[i] = np.ascontiguousarray(a)
        start += n
    return out  # type: ignore[return-value]

  return apply_layout(separate, [array])


class QuantizingReader:
  """An ``Fp8Reader`` over a float checkpoint: each source tensor quantized into MXFP8 as it is read (the
  reference quantizer, ``quantized.quantize_mxfp8``). Values and scales are separate parameters, built one after
  the other, so each reads its sources (their scales are 1/32 of the values': holding one for the other would
  cost a whole expert stack in memory)."""

  def __init__(self, source):
    self.source = source

  def get_values(self, name: str, rows: slice | None = None) -> np.ndarray:
    return q.quantize_mxfp8(self.source.get(name, rows))[0]

  def get_scales(self, name: str, rows: slice | None = None) -> np.ndarray:
    return q.quantize_mxfp8(self.source.get(name, rows))[1]


def specs_to_json(specs: Mapping[ParamPath, QuantSpec]) -> dict[str, dict]:
  return {"/".join(map(str, path)): spec.to_json() for path, spec in specs.items()}


def specs_from_json(raw: Mapping[str, Mapping]) -> dict[ParamPath, QuantSpec]:
  return {tuple(int(k) if k.isdigit() else k for k in key.split("/")): QuantSpec.from_json(v)
          for key, v in raw.items()}


def dequantized_param(path: ParamPath, values: np.ndarray, scales: np.ndarray, spec: QuantSpec,
                      shape: Sequence[int]) -> np.ndarray:
  """A kept parameter's values / scales -> the fp32 parameter of ``shape`` in m3jax's layout [*batch, *in, *out]."""
  from m3jax.checkpoint.fastops import transpose_last2  # pylint: disable=g-import-not-at-top

  w = q.dequantize_blocked(values, scales, spec.block)
  return transpose_last2(np.ascontiguousarray(w)).reshape(tuple(shape))
