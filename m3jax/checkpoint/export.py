"""m3jax Orbax checkpoint -> original-layout safetensors (what MiniMax releases and HF ``from_pretrained`` loads).

Streams: each parameter (stacked experts a group of experts at a time) is read from the Orbax state with
TensorStore, split back into checkpoint tensors by the inverse transforms of the same TensorRules the loader
uses, and appended to a safetensors shard whose header was written up front. MTP tensors are written back
under their original names (the vision tower, when present, is part of the model parameters).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from tqdm.auto import tqdm

from m3jax.checkpoint import converted, fp8_params, fsutil, orbax_io
from m3jax.checkpoint import quantized as q
from m3jax.checkpoint.loader import abstract_model, build_rules
from m3jax.checkpoint.pieces import Piece, split_fp8, split_rule
from m3jax.checkpoint.safetensors_dir import INDEX_NAME, CheckpointError
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES, SAFETENSORS_DTYPES, StreamingWriter
from m3jax.config import M3Config

DEFAULT_SHARD_BYTES = 5 * 2**30
DEFAULT_PIECE_BYTES = 128 << 20
MTP_PREFIX = "language_model.model.mtp."
HF_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"


@dataclasses.dataclass
class ExportSummary:
  src: str
  out: str
  tensors: int
  shards: int
  bytes_written: int
  seconds: float

  def lines(self) -> list[str]:
    rate = self.bytes_written / 1e9 / max(self.seconds, 1e-9)
    out = [f"exported {self.src} -> {self.out} (original layout)",
           f"  {self.tensors} tensors in {self.shards} safetensors file(s), {fsutil.format_bytes(self.bytes_written)} "
           f"in {self.seconds:.1f} s ({rate:.3f} GB/s)"]
    return out


def hf_config(cfg: M3Config, dtype: str) -> dict:
  """config.json for the exported checkpoint: the normalised config plus what HF ``from_pretrained`` needs."""
  out = cfg.to_dict()
  out["architectures"] = [HF_ARCHITECTURE]
  out["dtype"] = dtype
  out["text_config"]["dtype"] = dtype
  return out


def _scale_name(weight: str) -> str:
  return weight[: -len(".weight")] + q.SCALE_INV


def export_quantization_config(specs: dict, recorded: dict | None, quantized: list[str], plain: list[str]) -> dict:
  """quantization_config of an export with weights in fp8: the format of ``specs`` (one for the whole export),
  and ignored_layers = the recorded list's entries that match no quantized module, plus the full name of every
  float Linear module they do not cover (so that the exact checks of m3jax and HF hold: ``quantized`` and
  ``plain`` are the exported Linear modules, without '.weight')."""
  kinds = {(spec.fmt, spec.source_block) for spec in specs.values()}
  if len(kinds) != 1:
    raise CheckpointError(f"the fp8 weights mix formats {sorted(kinds)}; one quantization_config cannot declare them")
  fmt, block = kinds.pop()
  out: dict = {"quant_method": "mxfp8"} if fmt == "mxfp8" else {"quant_method": "fp8",
                                                                 "weight_block_size": list(block)}
  base = list(q.QuantConfig.from_config({"quantization_config": recorded}).ignored) if recorded else []
  matcher = q.QuantConfig(method=out["quant_method"])
  patterns = [p for p in base if not any(dataclasses.replace(matcher, ignored=(p,)).is_ignored(m) for m in quantized)]
  cover = dataclasses.replace(matcher, ignored=tuple(patterns))
  out["ignored_layers"] = patterns + [m for m in plain if not cover.is_ignored(m)]
  return out


def export(src: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, max_piece_bytes: int = DEFAULT_PIECE_BYTES,
           progress: bool = True) -> ExportSummary:
  """Writes the m3jax checkpoint ``src`` back as an original-layout safetensors checkpoint at ``out``. Weights it
  stores in fp8 are written in their checkpoint format (``weight`` F8_E4M3 + ``weight_scale_inv``) with a
  ``quantization_config`` declaring it (``export_quantization_config``).

  Args:
    src: a directory written by ``m3jax convert``.
    out: output directory (config.json, model[-0000i-of-0000n].safetensors, index, tokenizer files); must not
      exist unless ``force``. Written atomically.
    max_shard_bytes: safetensors shard size limit.
  """
  start = time.perf_counter()
  src, out = os.fspath(src), os.fspath(out)
  if not converted.is_converted(src):
    raise CheckpointError(f"{src}: not an m3jax checkpoint (no {converted.MARKER}); `m3jax export` reads the "
                          "output of `m3jax convert`")
  fsutil.check_destination(out, force, sources=(src,))
  marker = converted.read_marker(src)
  cfg = M3Config.from_file(src)
  specs = converted.quantized_specs(marker)
  _, flat = abstract_model(cfg, np.dtype(marker["dtype"]), quantized=specs)
  meta = converted.check_params(src, flat)
  reader = orbax_io.SliceReader(converted.state_dir(src))

  # Production order: steps (state key, piece or None for a whole extra tensor, output names) and the output
  # tensors (name, full shape, dtype) in the order their first bytes are produced.
  steps: list[tuple[orbax_io.KeyPath, Piece | None, tuple[str, ...]]] = []
  entries: list[tuple[str, tuple[int, ...], str]] = []
  linear_modules: dict[str, list[str]] = {"quantized": [], "plain": []}
  for rule in build_rules(cfg, "original"):
    key = converted.model_key(rule.path)
    shapes = dict(zip(rule.sources, rule.source_shapes))
    seen: set[str] = set()
    spec = specs.get(rule.path)
    if spec is not None:  # fp8: values as the weights, scales as their weight_scale_inv, in the source's block
      linear_modules["quantized"] += [n[: -len(".weight")] for n in rule.sources]
      for part in fp8_params.PARTS:
        info = meta[key + (part,)]
        st_dtype = SAFETENSORS_DTYPES[info.dtype]
        for piece in split_fp8(rule, part, spec, info.shape, info.dtype.itemsize, max_piece_bytes):
          names = piece.names if part == "values" else tuple(_scale_name(n) for n in piece.names)
          steps.append((key + (part,), piece, names))
          for n, name in zip(piece.names, names):
            if name not in seen:
              shape = shapes[n] if part == "values" else q.scale_grid(shapes[n], spec.source_block)
              entries.append((name, shape, st_dtype))
          seen.update(names)
      continue
    info = meta[key]
    st_dtype = SAFETENSORS_DTYPES[info.dtype]
    linear_modules["plain"] += [n[: -len(".weight")] for n, s in shapes.items() if q.is_linear_weight(n, len(s))]
    for piece in split_rule(rule, info.shape, info.dtype.itemsize, max_piece_bytes):
      steps.append((key, piece, piece.names))
      entries += [(n, shapes[n], st_dtype) for n in piece.names if n not in seen]
      seen.update(piece.names)
  for rel in converted.extra_names(marker, converted.MTP):
    info = meta[converted.extra_key(converted.MTP, rel)]
    steps.append((converted.extra_key(converted.MTP, rel), None, (MTP_PREFIX + rel,)))
    entries.append((MTP_PREFIX + rel, info.shape, SAFETENSORS_DTYPES[info.dtype]))
    if q.is_linear_weight(MTP_PREFIX + rel, len(info.shape)):
      linear_modules["plain"].append((MTP_PREFIX + rel)[: -len(".weight")])
  config = hf_config(cfg, marker["dtype"])
  if specs:
    recorded = (marker.get(converted.QUANTIZED) or {}).get("quantization_config")
    config["quantization_config"] = export_quantization_config(specs, recorded, **linear_modules)

  shards = _assign_shards(entries, max_shard_bytes)
  n_shards = max(shards.values(), default=0) + 1
  fnames = ["model.safetensors"] if n_shards == 1 else [
      f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
  total = sum(_nbytes(s, d) for _, s, d in entries)
  bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=not progress,
             dynamic_ncols=True, leave=False)
  try:
    with fsutil.atomic_output_dir(out, force) as tmp:
      writers: dict[int, StreamingWriter] = {}

      def writer_for(name: str) -> StreamingWriter:
        i = shards[name]
        if i not in writers:
          for j in list(writers):
            writers.pop(j).close()
          writers[i] = StreamingWriter(os.path.join(tmp, fnames[i]),
                                       [e for e in entries if shards[e[0]] == i], {"format": "pt"})
        return writers[i]

      for key, piece, names in steps:
        arrays = [reader.read(key)] if piece is None else piece.split(reader.read(key, piece.index))
        for name, arr in zip(names, arrays, strict=True):
          writer_for(name).write(name, arr)
          bar.update(arr.nbytes)
      for w in writers.values():
        w.close()
      if n_shards > 1:
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
          json.dump({"metadata": {"total_size": total},
                     "weight_map": {name: fnames[shards[name]] for name, _, _ in entries}}, f, indent=2)
      with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
      fsutil.copy_aux_files(src, tmp)
      fsutil.write_export_marker(tmp, source=os.path.abspath(src))  # lets a later --force replace it
  finally:
    bar.close()
  return ExportSummary(src=src, out=out, tensors=len(entries), shards=n_shards, bytes_written=total,
                       seconds=time.perf_counter() - start)


def _nbytes(shape: tuple[int, ...], st_dtype: str) -> int:
  return int(np.prod(shape, dtype=np.int64)) * NUMPY_DTYPES[st_dtype].itemsize


def _assign_shards(entries: list[tuple[str, tuple[int, ...], str]], max_bytes: int) -> dict[str, int]:
  """Tensor name -> shard index, filling shards in order up to ``max_bytes`` (a bigger tensor gets its own)."""
  out, shard, size = {}, 0, 0
  for name, shape, dtype in entries:
    n = _nbytes(shape, dtype)
    if size and size + n > max_bytes:
      shard, size = shard + 1, 0
    out[name] = shard
    size += n
  return out
