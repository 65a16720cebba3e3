"""A layer's fp8 input projections (q / k / v, and the index q / k on sparse layers) as one ``QuantizedWeight``,
built once before a decode loop: the fp8 counterpart of ``m3jax.parallel.projection``'s bf16 fusion.

Why: at decode a dense fp8 projection sits on a per-call floor (~45-60 us on an H100, BENCHMARKS.md "FP8 weights")
and a small one (M3's k / v: 3 MB of fp8 at full width, 0.8 MB on one GPU of 8) cannot reach the card's bandwidth
on its own; one fused weight is one launch that streams every row. The weights share their input (the layer's
normed hidden state), so their values [out_i, in] stack along ``out`` and their scales with them
(``pallas_kernels.quant.concat_out``: MXFP8's per-row scales concatenate exactly). The product is split back
into each projection's [B, S, N_i, D_i].

Fused only where the result is what the kernels take and the layout is one device's: every weight fp8 in one
format and block (a mix of bf16 and fp8 weights, or fp8_block parts that end inside a 128-row block, project one
by one), and no multi-device sharding plan (there each projection runs the reference, which the compiler
partitions; a per-device fusion comes with a per-device fp8 kernel).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax

from m3jax.layers.quantized import QuantizedLinear
from m3jax.ops.dispatch import KernelChoice
from m3jax.ops.linear import quantized_linear
from m3jax.sharding import current_plan
from pallas_kernels.quant import QuantizedWeight, concat_block, concat_out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedQuantizedWeights:
  """fp8 projection weights concatenated along their output rows.

  weight: QuantizedWeight [sum_i N_i * D_i, H] (rows of weight 0, then weight 1, ...).
  out_shapes: each projection's (N_i, D_i) output dims, in order (a [H, D] weight counts as N = 1).
  """

  weight: QuantizedWeight
  out_shapes: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))


def _out_shape(layer: QuantizedLinear) -> tuple[int, int]:
  out = tuple(layer.out_shape)
  return (1, out[0]) if len(out) == 1 else (out[0], math.prod(out[1:]))


def fuse_quantized(layers: Sequence[QuantizedLinear]) -> FusedQuantizedWeights | None:
  """``layers`` (non-batched fp8 weights of one input) as one fused weight, or None where they are not fused
  (module docstring: mixed formats / blocks / inputs, blocks the concatenation would re-cut, a multi-device
  plan)."""
  plan = current_plan()
  if plan is not None and not plan.is_trivial:
    return None
  if not layers or not all(isinstance(l, QuantizedLinear) for l in layers):
    return None
  first = layers[0]
  if any((l.fmt, tuple(l.block), tuple(l.in_shape)) != (first.fmt, tuple(first.block), tuple(first.in_shape))
         for l in layers):
    return None
  weights = [l.weight() for l in layers]
  if concat_block([w.shape[0] for w in weights], first.fmt, tuple(first.block)) != tuple(first.block):
    return None
  values, scales, block = concat_out([(w.values, w.scales) for w in weights], first.fmt, tuple(first.block))
  return FusedQuantizedWeights(QuantizedWeight(values, scales, first.fmt, block),
                               tuple(_out_shape(l) for l in layers))


def project_fused_quantized(x: jax.Array, fused: FusedQuantizedWeights, *, kernels: KernelChoice
                            ) -> list[jax.Array]:
  """x [B, S, H] -> [B, S, N_i, D_i] per fused projection, in x.dtype: one fp8 projection, split back."""
  b, s, h = x.shape
  y = quantized_linear(x.reshape(b * s, h), fused.weight, kernels=kernels)
  outs, start = [], 0
  for n, d in fused.out_shapes:
    outs.append(y[:, start:start + n * d].reshape(b, s, n, d))
    start += n * d
  return outs
