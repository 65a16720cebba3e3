"""Safetensors checkpoint (original MiniMax or HF layout, plain or quantized) -> m3jax Orbax checkpoint.

Streams tensor by tensor: every parameter is built from its source tensors (dequantized, transposed, stacked,
cast) only when Orbax's writer reaches it, and large arrays (stacked experts, embedding, LM head) are built and
written in pieces (pieces.py), so peak host memory is bounded by the piece size (about 3 x 128 MiB + 256 MiB
in flight), not by the model or its largest array. The output appears atomically (fsutil.atomic_output_dir).
Layout of the result: converted.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import time

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from m3jax.checkpoint import converted, fp8_params, fsutil, orbax_io
from m3jax.checkpoint.loader import abstract_model, cast, default_run_dtype, plan_text_load
from m3jax.checkpoint.mapping import LAYOUTS, prefixes
from m3jax.checkpoint.pieces import Piece, split_fp8, split_rule
from m3jax.checkpoint.safetensors_dir import CheckpointError
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES
from m3jax.checkpoint.source import FLOAT_DTYPES, TensorSource
from m3jax.config import M3Config

DEFAULT_PIECE_BYTES = 128 << 20
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# Extra tensors that stay fp32 like the model's router (gate weight [E, H] and the correction bias).
_FP32_SUFFIXES = ("block_sparse_moe.gate.weight", "mlp.gate.weight", "e_score_correction_bias")


@dataclasses.dataclass
class ConvertSummary:
  """What a conversion did (also printed by ``m3jax convert``)."""

  src: str
  dst: str
  layout: str
  dtype: str
  quantization: str | None
  seconds: float = 0.0
  params: int = 0
  source_tensors: int = 0
  bytes_read: int = 0
  bytes_written: int = 0
  kept: dict[str, int] = dataclasses.field(default_factory=dict)
  skipped: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  dequantized: dict[str, int] = dataclasses.field(default_factory=dict)
  kept_fp8: dict[str, int] = dataclasses.field(default_factory=dict)  # fmt -> parameters stored in fp8
  quantized_into: str | None = None  # --quantize
  aux_files: list[str] = dataclasses.field(default_factory=list)

  def lines(self) -> list[str]:
    rate = self.bytes_read / max(self.seconds, 1e-9)
    quant = f", {self.quantization} quantized" if self.quantization else ""
    out = [f"converted {self.src} ({self.layout} layout{quant}) -> {self.dst} ({self.dtype})",
           f"  {self.params} parameters" + "".join(f" + {n} {k} tensors" for k, n in self.kept.items() if n)
           + f" from {self.source_tensors} source tensors in {self.seconds:.1f} s",
           f"  read {fsutil.format_bytes(self.bytes_read)}, wrote {fsutil.format_bytes(self.bytes_written)}: "
           f"{rate / 1e9:.3f} GB/s"]
    if self.dequantized:
      out.append("  dequantized " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.dequantized.items())) +
                 " tensors")
    if self.kept_fp8:
      how = f"quantized into {self.quantized_into}" if self.quantized_into else "kept in fp8"
      out.append(f"  {how}: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.kept_fp8.items())) +
                 " parameters (values + scales)")
    n_skipped = sum(len(v) for v in self.skipped.values())
    if n_skipped:
      parts = [f"{k} {len(v)} (e.g. {v[0]})" for k, v in sorted(self.skipped.items()) if v]
      out.append(f"  skipped {n_skipped} tensors: " + "; ".join(parts))
    else:
      out.append("  skipped nothing")
    if self.aux_files:
      out.append("  copied " + ", ".join(self.aux_files))
    return out


class _Progress:
  """tqdm bar over output bytes, with a tensors-done counter."""

  def __init__(self, total_bytes: int, total_tensors: int, enabled: bool):
    self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
                    disable=not enabled, dynamic_ncols=True, leave=False, postfix=f"0/{total_tensors} tensors")
    self.done, self.total, self.written = 0, total_tensors, 0

  def callback(self, n_pieces: int):
    """on_piece callback for one leaf of ``n_pieces`` pieces."""
    remaining = [n_pieces]

    def on_piece(nbytes: int) -> None:
      self.written += nbytes
      remaining[0] -= 1
      if remaining[0] == 0:
        self.done += 1
        self.bar.set_postfix_str(f"{self.done}/{self.total} tensors", refresh=False)
      self.bar.update(nbytes)

    return on_piece

  def close(self) -> None:
    self.bar.close()


def extra_category(name: str) -> str:
  """'mtp' for MTP tensors, 'vision' for the vision tower / projectors (names the text backbone skips)."""
  return "mtp" if name.startswith("mtp.") or ".mtp." in name else "vision"


def mtp_relative(name: str) -> str:
  """'language_model.model.mtp.layers.0.enorm.weight' -> 'layers.0.enorm.weight'."""
  return name[4:] if name.startswith("mtp.") else name[name.index(".mtp.") + 5:]


def _extra_dtype(name: str, stored: str, target: np.dtype) -> np.dtype:
  if stored not in FLOAT_DTYPES:
    return NUMPY_DTYPES[stored]
  return np.dtype(np.float32) if name.endswith(_FP32_SUFFIXES) else target


# What ``--quantize`` leaves unquantized, as quantization_config's ignored_layers (m3jax.checkpoint.quantized's
# matching: runs of dotted name components): router gates, LM head, vision tower / projectors, MTP modules.
QUANTIZE_IGNORED = ("lm_head", "block_sparse_moe.gate", "mlp.gate", "vision_tower", "multi_modal_projector",
                    "patch_merge_mlp", "mtp")


def _quantization_config(src: str, quantize: str | None) -> dict:
  """The quantization_config recorded with weights stored in fp8: the source's own (--keep-quantized) or the one
  --quantize implies."""
  if quantize is not None:
    return {"quant_method": quantize, "ignored_layers": list(QUANTIZE_IGNORED)}
  with open(os.path.join(src, "config.json")) as f:
    raw = json.load(f)
  return dict(raw.get("quantization_config") or (raw.get("text_config") or {})["quantization_config"])


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str | None = "auto", layout: str = "auto",
            force: bool = False, keep_mtp: bool = True, text_only: bool = False,
            max_piece_bytes: int = DEFAULT_PIECE_BYTES, progress: bool = True, keep_quantized: bool = False,
            quantize: str | None = None) -> ConvertSummary:
  """Converts safetensors checkpoint ``src`` into an m3jax Orbax checkpoint at ``dst``.

  Args:
    src: checkpoint directory (config.json + safetensors, single or sharded).
    dst: output directory; must not exist unless ``force``.
    dtype: 'auto' (the checkpoint's own: embedding dtype), 'bfloat16' or 'float32'. Quantized weights are
      dequantized to it (unless kept); router weights stay fp32.
    layout: 'auto' | 'original' | 'hf' | 'hf_text'.
    keep_mtp: keep the ``mtp.*`` tensors in their own subtree (else they are skipped and listed).
    text_only: drop the vision tower + projector (the output config then has no vision_config).
    max_piece_bytes: large arrays (stacked experts, embedding, LM head) are built and written in pieces of at
      most this many bytes (see pieces.py).
    progress: show a tqdm bar.
    keep_quantized: store the linear weights the checkpoint keeps in MXFP8 / FP8-block as they are (fp8 values +
      scales, read without dequantizing); ``m3jax.load(dst)`` restores them in fp8 (m3jax.layers.quantized).
    quantize: 'mxfp8' quantizes a float checkpoint's linear weights (routed / shared experts, dense MLPs,
      attention and indexer projections; not routers, norms, embeddings, LM head, vision or MTP) on the way.
  """
  start = time.perf_counter()
  src, dst = os.fspath(src), os.fspath(dst)
  if converted.is_converted(src):
    raise CheckpointError(f"{src} is already an m3jax checkpoint (use `m3jax export` to get safetensors back)")
  fsutil.check_destination(dst, force, sources=(src,))
  if layout != "auto" and layout not in LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; expected auto or one of {LAYOUTS}")
  if dtype not in (None, "auto") and str(dtype) not in DTYPES:
    raise ValueError(f"unknown dtype {dtype!r}; expected auto, bfloat16 or float32")
  if quantize is not None and quantize != "mxfp8":
    raise ValueError(f"unknown --quantize format {quantize!r}; m3jax quantizes into mxfp8")
  if quantize is not None and keep_quantized:
    raise ValueError("pass --quantize (quantize a float checkpoint) or --keep-quantized (keep a quantized "
                     "checkpoint's own format), not both")
  cfg = M3Config.from_file(src)
  skip_vision = text_only and cfg.vision is not None
  if text_only:
    cfg = dataclasses.replace(cfg, vision=None)
  source = TensorSource.open(src)
  if quantize is not None and source.quant is not None:
    raise CheckpointError(f"{src}: --quantize {quantize}: the checkpoint is already quantized (quant_method "
                          f"{source.quant.method!r}); use --keep-quantized to keep its own format")
  layout_, rules = plan_text_load(cfg, source, None if layout == "auto" else layout,  # type: ignore[arg-type]
                                  skip_vision=skip_vision)
  target = default_run_dtype(source, layout_) if dtype in (None, "auto") else jnp.dtype(DTYPES[str(dtype)])
  if quantize is not None:
    specs, reader = fp8_params.quantize_specs(rules, quantize), fp8_params.QuantizingReader(source)
  else:
    specs, reader = (fp8_params.kept_specs(rules, source) if keep_quantized else {}), source
  _, flat = abstract_model(cfg, target, quantized=specs)
  by_path = {rule.path: rule for rule in rules}
  summary = ConvertSummary(src=src, dst=dst, layout=layout_, dtype=jnp.dtype(target).name,
                           quantization=source.quant.method if source.quant else None, quantized_into=quantize)

  # Parameters (a weight kept in fp8 is two leaves, .../values and .../scales).
  plans: list[tuple[orbax_io.KeyPath, tuple[int, ...], np.dtype, list[Piece]]] = []
  used: list[str] = []
  built: set = set()
  for path, var in flat:
    var_dtype = np.dtype(var.dtype)
    if path[:-1] in specs and path[-1] in fp8_params.PARTS:
      rule = by_path[path[:-1]]
      pieces = split_fp8(rule, path[-1], specs[rule.path], tuple(var.shape), var_dtype.itemsize, max_piece_bytes)
    else:
      rule = by_path[path]
      pieces = split_rule(rule, tuple(var.shape), var_dtype.itemsize, max_piece_bytes)
    plans.append((converted.model_key(path), tuple(var.shape), var_dtype, pieces))
    if rule.path not in built:
      used += rule.sources
    built.add(rule.path)
  if set(by_path) != built:
    raise CheckpointError(f"internal: rules without parameters: {sorted(set(by_path) - built)[:3]}")
  used_set = set(used)
  kept_sources = {name for path in specs for name in by_path[path].sources}

  # Extra tensors: MTP (kept raw in its own subtree) or skipped, like the vision tensors of a text-only run.
  extras: dict[str, dict[str, str]] = {converted.MTP: {}}
  skipped: dict[str, list[str]] = collections.defaultdict(list)
  extra_plans = []
  head = prefixes(layout_)[1]
  for name in source.keys():
    if name in used_set:
      continue
    if cfg.text.tie_word_embeddings and name == head:
      skipped["tied lm_head"].append(name)
      continue
    category = extra_category(name)
    if category != "mtp" or not keep_mtp:
      skipped[category].append(name)
      continue
    rel = mtp_relative(name)
    extras[category][rel] = name
    extra_plans.append((converted.extra_key(category, rel), name, _extra_dtype(name, source.dtype(name), target)))
  skipped["activation scales"] = list(source.activation_scales)
  source.check([name for _, name, _ in extra_plans])

  # Lazy leaves.
  total_bytes = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, s, d, _ in plans)
  total_bytes += sum(int(np.prod(source.shape(n), dtype=np.int64)) * d.itemsize for _, n, d in extra_plans)
  bar = _Progress(total_bytes, len(plans) + len(extra_plans), progress)
  leaves: dict[orbax_io.KeyPath, orbax_io.LazyArray] = {}

  def build(piece: Piece, out_dtype: np.dtype, fp8: bool) -> np.ndarray:
    if fp8:  # values / scales as assembled (no cast)
      return np.asarray(piece.build(reader))
    return cast(np.asarray(piece.build(source)), out_dtype)

  def read_extra(name: str, out_dtype: np.dtype) -> np.ndarray:
    return cast(np.asarray(source.get(name)), out_dtype)

  fp8_keys = {converted.model_key(p + (part,)) for p in specs for part in fp8_params.PARTS}
  for key, shape, var_dtype, pieces in plans:
    fp8 = key in fp8_keys
    leaves[key] = orbax_io.LazyArray(shape, var_dtype, [(p.index, functools.partial(build, p, var_dtype, fp8))
                                                        for p in pieces], bar.callback(len(pieces)))
  for key, name, out_dtype in extra_plans:
    shape = source.shape(name)
    leaves[key] = orbax_io.LazyArray(shape, out_dtype, [(tuple(slice(0, n) for n in shape),
                                                         functools.partial(read_extra, name, out_dtype))],
                                     bar.callback(1))
  try:
    tree = orbax_io.nest(leaves)
  except ValueError as e:
    raise CheckpointError(f"{src}: cannot store tensors as a tree: {e}") from None

  consumed = used + [name for _, name, _ in extra_plans]
  for name in consumed:
    fmt = source.quant_format(name)
    if fmt and name not in kept_sources:
      summary.dequantized[fmt] = summary.dequantized.get(fmt, 0) + 1
  for spec in specs.values():
    summary.kept_fp8[spec.fmt] = summary.kept_fp8.get(spec.fmt, 0) + 1
  quant_config = _quantization_config(src, quantize) if specs else None
  try:
    with fsutil.atomic_output_dir(dst, force) as tmp:
      orbax_io.save_streaming(os.path.join(tmp, converted.STATE), tree)
      with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg.to_dict() | ({"quantization_config": quant_config} if quant_config else {}), f, indent=2)
      summary.aux_files = fsutil.copy_aux_files(src, tmp)
      marker = {
          "format": converted.FORMAT, "version": converted.VERSION, "dtype": summary.dtype,
          "source": {"path": os.path.abspath(src), "layout": layout_, "quantization": summary.quantization,
                     "dequantized": summary.dequantized, "tensors": sum(len(source.physical(n)) for n in consumed),
                     "bytes": sum(source.nbytes(n) for n in consumed)},
          "extras": extras,
          "skipped": {k: v for k, v in skipped.items() if v},
          **({converted.QUANTIZED: {"quantization_config": quant_config,
                                    "params": fp8_params.specs_to_json(specs)}} if specs else {}),
          "aux_files": summary.aux_files,
      }
      with open(os.path.join(tmp, converted.MARKER), "w") as f:  # last: marks the directory complete
        json.dump(marker, f, indent=2)
  finally:
    bar.close()
  summary.seconds = time.perf_counter() - start
  summary.params = len(plans)
  summary.kept = {k: len(v) for k, v in extras.items()}
  summary.skipped = {k: v for k, v in skipped.items() if v}
  summary.source_tensors = marker["source"]["tensors"]
  summary.bytes_read = marker["source"]["bytes"]
  summary.bytes_written = bar.written
  return summary
