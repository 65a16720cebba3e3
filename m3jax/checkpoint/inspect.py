"""Summaries of a checkpoint directory (safetensors source or m3jax-converted) without reading tensor data:
config, parameter count by component, dtypes and bytes on disk."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from m3jax.checkpoint import converted, fsutil
from m3jax.checkpoint.convert import extra_category
from m3jax.checkpoint.fsutil import format_bytes
from m3jax.checkpoint.loader import abstract_model, checkpoint_dtype, plan_text_load
from m3jax.checkpoint.mapping import EXPERT_PARAMS
from m3jax.checkpoint.safetensors_stream import NUMPY_DTYPES, SAFETENSORS_DTYPES
from m3jax.checkpoint.source import TensorSource
from m3jax.config import M3Config

COMPONENTS = ("embeddings", "attention", "indexer", "dense MLP", "routed experts", "shared experts", "router",
              "norms", "lm_head", "vision", "MTP module")


def component(path: Sequence[Any]) -> str:
  """The component a model parameter path belongs to (one of COMPONENTS); a weight kept in fp8 (.../values,
  .../scales) belongs to its weight's."""
  names = [str(p) for p in path]
  if len(names) > 1 and names[-1] in ("values", "scales"):
    names = names[:-1]
  if names[0] == "vision":
    return "vision"
  if names[0] == "mtp":
    return "MTP module"
  if names == ["embed"]:
    return "embeddings"
  if names == ["lm_head"]:
    return "lm_head"
  if any(n.endswith("norm") for n in names):
    return "norms"
  if "indexer" in names:
    return "indexer"
  if "attn" in names:
    return "attention"
  if names[-1] in ("router", "correction_bias"):
    return "router"
  if names[-1] in EXPERT_PARAMS:
    return "routed experts"
  if "shared" in names:
    return "shared experts"
  return "dense MLP"


@dataclasses.dataclass
class Report:
  """Counts and sizes; ``params`` / ``stored`` are (elements, bytes as stored) per component."""

  path: str
  kind: str
  config: M3Config
  dtype: str
  quantization: str | None
  params: dict[str, tuple[int, int]]
  extras: dict[str, tuple[int, int, str]]  # category -> (tensors, elements, 'kept' | 'skipped')
  dtypes: dict[str, tuple[int, int]]  # stored dtype -> (tensors, bytes)
  disk_bytes: int
  files: int

  def lines(self) -> list[str]:
    t = self.config.text
    n_full = sum(a == "full" for a in t.attention_types)
    out = [f"{self.path}: {self.kind}",
           f"config: {t.num_layers} layers ({n_full} full / {t.num_sparse_layers} sparse attention; "
           f"{t.num_layers - t.num_moe_layers} dense / {t.num_moe_layers} MoE MLP), hidden {t.hidden_size}, "
           f"vocab {t.vocab_size}",
           f"  attention: {t.num_heads} q heads / {t.num_kv_heads} kv heads x {t.head_dim}, rotary {t.rotary_dim}, "
           f"theta {t.rope_theta:g}; indexer {t.index_num_heads} heads x {t.index_head_dim}, block "
           f"{t.index_block_size}, top-{t.index_topk_blocks} (local {t.index_local_blocks}, init "
           f"{t.index_init_blocks})",
           f"  MLP: {t.num_experts} experts (top-{t.num_experts_per_tok}) x {t.intermediate_size}, shared "
           f"{t.shared_intermediate_size}, dense {t.dense_intermediate_size}; tied embeddings: "
           f"{t.tie_word_embeddings}; MTP modules: {t.num_mtp_modules}",
           f"  vision: {'none' if self.config.vision is None else f'{self.config.vision.num_layers} layers x '
                                                                   f'{self.config.vision.hidden_size}'}; "
           f"dtype {self.dtype}; quantization: {self.quantization or 'none'}",
           "parameters by component:"]
    total = sum(n for n, _ in self.params.values())
    for name in COMPONENTS:
      n, b = self.params.get(name, (0, 0))
      if n:
        out.append(f"  {name:<15} {_count(n):>10}  {100 * n / max(total, 1):5.1f}%  {_size(b):>10} stored")
    out.append(f"  {'total':<15} {_count(total):>10}  100.0%  {_size(sum(b for _, b in self.params.values())):>10}")
    for cat, (n, elems, status) in sorted(self.extras.items()):
      if n:
        count = _count(elems) if elems else "?"
        out.append(f"  {cat:<15} {count:>10}  not in the total: {n} tensors, {status}")
    out.append("dtypes: " + ", ".join(f"{d} {n} tensors / {_size(b)}" for d, (n, b) in sorted(self.dtypes.items())))
    out.append(f"on disk: {_size(self.disk_bytes)} in {self.files} files")
    return out


def _count(n: int) -> str:
  for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.2f}{unit}"
  return str(n)


def _size(b: int) -> str:
  return format_bytes(b)


def inspect_checkpoint(path: str | os.PathLike) -> Report:
  """Reads config.json and tensor metadata of ``path`` (safetensors directory or m3jax-converted)."""
  path = os.fspath(path)
  if converted.is_converted(path):
    return _inspect_converted(path)
  return _inspect_source(path)


def _files(path: str) -> int:
  return sum(len(files) for _, _, files in os.walk(path))


def _inspect_source(path: str) -> Report:
  cfg = M3Config.from_file(path)
  source = TensorSource.open(path)
  layout, rules = plan_text_load(cfg, source)
  params: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  used = set()
  for rule in rules:
    c = params[component(rule.path)]
    for name in rule.sources:
      c[0] += int(np.prod(source.shape(name), dtype=np.int64))
      c[1] += source.nbytes(name)
      used.add(name)
  extras: dict[str, list] = {}
  for name in source.keys():
    if name in used:
      continue
    category = extra_category(name)
    note = ("loaded only with with_mtp=True (speculative decoding)" if category == "mtp"
            else "skipped by the text model")
    e = extras.setdefault(category, [0, 0, note])
    e[0] += 1
    e[1] += int(np.prod(source.shape(name), dtype=np.int64))
  dtypes: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  ckpt = source.ckpt
  for name in ckpt.keys():
    d = dtypes[ckpt.dtype(name)]
    d[0] += 1
    d[1] += int(np.prod(ckpt.shape(name), dtype=np.int64)) * NUMPY_DTYPES[ckpt.dtype(name)].itemsize
  kind = f"safetensors checkpoint, {layout} layout, {len(set(ckpt.file_of(n) for n in ckpt.keys()))} file(s)"
  return Report(path=path, kind=kind, config=cfg, dtype=str(np.dtype(checkpoint_dtype(source, layout))),
                quantization=source.quant.method if source.quant else None,
                params={k: tuple(v) for k, v in params.items()}, extras={k: tuple(v) for k, v in extras.items()},
                dtypes={k: tuple(v) for k, v in dtypes.items()}, disk_bytes=fsutil.dir_bytes(path),
                files=_files(path))


def fp8_specs(path: str | os.PathLike, quantize: str | None = None) -> dict:
  """{parameter path: QuantSpec} of the weights a load keeps in fp8: those the checkpoint stores in fp8
  (``m3jax.load(path, keep_quantized=True)``; a converted checkpoint's recorded ones), or with ``quantize``
  ('mxfp8') those ``m3jax convert --quantize`` would quantize. Reads metadata only."""
  from m3jax.checkpoint import fp8_params  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint.loader import build_rules  # pylint: disable=g-import-not-at-top

  path = os.fspath(path)
  cfg = M3Config.from_file(path)
  if converted.is_converted(path):
    if quantize is not None:
      return fp8_params.quantize_specs(build_rules(cfg, "original"), quantize)
    return converted.quantized_specs(converted.read_marker(path))
  source = TensorSource.open(path)
  _, rules = plan_text_load(cfg, source)
  if quantize is not None:
    return fp8_params.quantize_specs(rules, quantize)
  return fp8_params.kept_specs(rules, source)


def _inspect_converted(path: str) -> Report:
  marker = converted.read_marker(path)
  cfg = M3Config.from_file(path)
  specs = converted.quantized_specs(marker)
  _, flat = abstract_model(cfg, np.dtype(marker["dtype"]), quantized=specs)
  meta = converted.check_params(path, flat)
  params: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  dtypes: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  extras: dict[str, list] = {}
  for key, info in meta.items():
    n = int(np.prod(info.shape, dtype=np.int64))
    b = n * info.dtype.itemsize
    d = dtypes[SAFETENSORS_DTYPES.get(info.dtype, str(info.dtype))]
    d[0] += 1
    d[1] += b
    if key[0] == converted.MODEL:
      c = params[component(key[1:])]
      c[0] += n
      c[1] += b
    else:
      e = extras.setdefault(key[0], [0, 0, "kept"])
      e[0] += 1
      e[1] += n
  for cat, names in marker.get("skipped", {}).items():
    if cat in converted.EXTRA_TREES:
      extras.setdefault(cat, [len(names), 0, "skipped at conversion"])
  src = marker["source"]
  stored = (marker.get(converted.QUANTIZED) or {}).get("quantization_config")
  if stored:
    quant = f", {len(specs)} linear weights kept in fp8 ({stored['quant_method']})"
  else:
    quant = f", dequantized from {src['quantization']}" if src.get("quantization") else ""
  kind = f"m3jax Orbax checkpoint (converted from {src['layout']}-layout safetensors{quant})"
  return Report(path=path, kind=kind, config=cfg, dtype=marker["dtype"],
                quantization=stored["quant_method"] if stored else None,
                params={k: tuple(v) for k, v in params.items()}, extras={k: tuple(v) for k, v in extras.items()},
                dtypes={k: tuple(v) for k, v in dtypes.items()}, disk_bytes=fsutil.dir_bytes(path),
                files=_files(path))
