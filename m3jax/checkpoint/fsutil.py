"""Filesystem helpers for writing checkpoints: atomic output directories and tokenizer/template side files."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import time
import uuid
from collections.abc import Iterator

from m3jax.checkpoint.safetensors_dir import CheckpointError

# Files that travel with the weights (tokenizer, chat template, generation and processor configs).
AUX_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "generation_config.json",
                "chat_template.*", "preprocessor_config.json", "video_preprocessor_config.json",
                "processor_config.json")
TMP_TAG = ".m3jax-tmp-"


def aux_files(src: str) -> list[str]:
  """Names of the side files present in ``src``."""
  return sorted(f for f in os.listdir(src) if os.path.isfile(os.path.join(src, f))
                and any(fnmatch.fnmatch(f, p) for p in AUX_PATTERNS))


def copy_aux_files(src: str, dst: str) -> list[str]:
  """Copies the tokenizer / template / generation-config files of ``src`` into ``dst``; returns their names."""
  names = aux_files(src)
  for name in names:
    shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
  return names


def format_bytes(n: float) -> str:
  """1234567 -> '1.23 MB' (decimal units)."""
  for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= div:
      return f"{n / div:.2f} {unit}"
  return f"{int(n)} B"


def dir_bytes(path: str) -> int:
  """Total size of the regular files under ``path``."""
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      full = os.path.join(root, f)
      if not os.path.islink(full):
        total += os.path.getsize(full)
  return total


def check_destination(dst: str, force: bool, *, sources: tuple[str, ...] = ()) -> None:
  """Refuses an existing ``dst`` without ``force`` and a ``dst`` that is (or contains) one of ``sources``."""
  real = os.path.realpath(dst)
  for src in sources:
    s = os.path.realpath(src)
    if real == s or s.startswith(real + os.sep) or real.startswith(s + os.sep):
      raise CheckpointError(f"{dst}: the output must be outside the input directory {src}")
  if os.path.lexists(dst) and not force:
    raise CheckpointError(f"{dst} already exists; pass --force to replace it")
  if os.path.lexists(dst) and not os.path.isdir(dst):
    raise CheckpointError(f"{dst} exists and is not a directory; refusing to replace it")


@contextlib.contextmanager
def atomic_output_dir(dst: str, force: bool = False) -> Iterator[str]:
  """Yields a fresh temporary sibling of ``dst``; on success it is renamed to ``dst`` (replacing an existing
  ``dst`` only with ``force``), on any exception it is deleted. An interrupted process leaves at most a
  ``.NAME.m3jax-tmp-*`` sibling, never a partial ``dst``."""
  dst = os.path.abspath(dst)
  check_destination(dst, force)
  parent, base = os.path.split(dst)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{base}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
  os.makedirs(tmp)
  try:
    yield tmp
    old = None
    if os.path.lexists(dst):
      check_destination(dst, force)
      old = os.path.join(parent, f".{base}.m3jax-old-{uuid.uuid4().hex[:8]}")
      os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  except BaseException:
    _remove(tmp)
    raise


def _remove(path: str, attempts: int = 5) -> None:
  """rmtree that tolerates writer threads still finishing inside ``path``."""
  for i in range(attempts):
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
      return
    time.sleep(0.1 * (i + 1))
