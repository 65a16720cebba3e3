"""Filesystem helpers for writing checkpoints: atomic output directories and tokenizer/template side files.

Outputs appear atomically: they are written into a temporary sibling ``.NAME.m3jax-tmp-PID-HOST-XXXXXXXX`` (the
writing process's id and a tag of its host) that is renamed to NAME once complete, and removed on any error,
Ctrl-C or SIGTERM. A process killed outright (SIGKILL, a power cut) leaves its temporary sibling behind; the next
run writing into the same parent directory removes those whose process is gone (and says so). Every output
carries a marker file (``m3jax_checkpoint.json`` from convert, ``m3jax_export.json`` from export and
write_checkpoint), and ``--force`` replaces only a directory holding one, or an empty one: never a user's other
files.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from m3jax import interrupts
from m3jax.checkpoint.safetensors_dir import CheckpointError

# Files that travel with the weights (tokenizer, chat template, generation and processor configs).
AUX_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "generation_config.json",
                "chat_template.*", "preprocessor_config.json", "video_preprocessor_config.json",
                "processor_config.json")
TMP_TAG = ".m3jax-tmp-"
OLD_TAG = ".m3jax-old-"
CONVERTED_MARKER = "m3jax_checkpoint.json"  # converted.MARKER (a directory written by m3jax convert)
EXPORT_MARKER = "m3jax_export.json"  # a safetensors directory written by m3jax export / write_checkpoint
EXPORT_FORMAT = "m3jax-export"
_MARKER_FORMATS = {CONVERTED_MARKER: "m3jax-orbax", EXPORT_MARKER: EXPORT_FORMAT}
# .NAME.m3jax-tmp-PID-HOST-XXXXXXXX (HOST: 8 hex digits; absent from the names of older m3jax versions)
_SIBLING = re.compile(r"^\.(.+)\.m3jax-(tmp|old)-(\d+)-(?:([0-9a-f]{8})-)?[0-9a-f]{8}$")
_HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


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


def write_export_marker(out_dir: str, **info: Any) -> None:
  """Marks ``out_dir`` as a safetensors checkpoint m3jax wrote (so that ``--force`` may replace it)."""
  with open(os.path.join(out_dir, EXPORT_MARKER), "w") as f:
    json.dump({"format": EXPORT_FORMAT, "version": 1, **info}, f, indent=2)


def is_m3jax_output(path: str) -> bool:
  """True for a directory m3jax wrote (it holds a marker file whose format is m3jax's)."""
  for name, fmt in _MARKER_FORMATS.items():
    try:
      with open(os.path.join(path, name)) as f:
        marker = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(marker, dict) and marker.get("format") == fmt:
      return True
  return False


def check_destination(dst: str, force: bool, *, sources: tuple[str, ...] = (), tidy: bool = True) -> None:
  """Refuses an existing ``dst`` without ``force``, and with it anything but an m3jax output or an empty
  directory; also a ``dst`` that is (or contains, or lies in) one of ``sources``. First tidies what interrupted
  runs left beside ``dst`` (``remove_stale_temporaries``; ``tidy``), so that an output one of them was replacing
  is back in place before it is looked at."""
  if tidy:
    parent, base = os.path.split(os.path.abspath(dst))
    remove_stale_temporaries(parent, base)
  real = os.path.realpath(dst)
  for src in sources:
    s = os.path.realpath(src)
    if real == s or s.startswith(real + os.sep) or real.startswith(s + os.sep):
      raise CheckpointError(f"{dst}: the output must be outside the input directory {src}")
  if not os.path.lexists(dst):
    return
  if not force:
    raise CheckpointError(f"{dst} already exists; pass --force to replace it (only an m3jax output or an empty "
                          "directory is replaced)")
  if os.path.islink(dst) or not os.path.isdir(dst):
    kind = "a symbolic link" if os.path.islink(dst) else "not a directory"
    raise CheckpointError(f"{dst} exists and is {kind}; refusing to replace it")
  try:
    empty = not os.listdir(dst)
  except OSError as e:
    raise CheckpointError(f"{dst}: cannot list it ({e.strerror}); refusing to replace it") from None
  if not empty and not is_m3jax_output(dst):
    raise CheckpointError(f"{dst} is not an m3jax output (no {CONVERTED_MARKER} or {EXPORT_MARKER}) and not empty: "
                          "--force replaces only those; remove it yourself or choose another directory")


def _alive(pid: int) -> bool:
  """Whether process ``pid`` exists on this host (one we may not signal counts as alive)."""
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:
    return True
  return True


def remove_stale_temporaries(parent: str, name: str | None = None) -> list[str]:
  """Tidies what processes of this host that no longer run left in ``parent``, saying so on stderr: their
  temporary siblings (``.NAME.m3jax-tmp-PID-*``) are removed; the previous output they were replacing
  (``.NAME.m3jax-old-PID-*``) is removed once the new NAME is in place, or else renamed back to NAME. Returns the
  paths removed or restored. Those of a running process, or of another host (a shared filesystem), are left
  alone; for output ``name``, a running one's is mentioned."""
  tidied = []
  try:
    entries = os.listdir(parent)
  except OSError:
    return tidied
  for entry in sorted(entries):
    match = _SIBLING.match(entry)
    path = os.path.join(parent, entry)
    if match is None or os.path.islink(path) or not os.path.isdir(path):
      continue
    output, kind, pid, host = match.group(1), match.group(2), int(match.group(3)), match.group(4)
    if host is not None and host != _HOST_TAG:
      continue
    if _alive(pid):
      if output == name and pid != os.getpid():
        print(f"[m3jax] note: {path} belongs to process {pid}, which is still running; left alone",
              file=sys.stderr)
      continue
    target = os.path.join(parent, output)
    if kind == "old" and not os.path.lexists(target):
      os.rename(path, target)
      tidied.append(path)
      print(f"[m3jax] restored {target} from {path}: process {pid} stopped while replacing it (--force)",
            file=sys.stderr)
      continue
    _remove(path)
    if not os.path.exists(path):
      tidied.append(path)
      what = "a temporary directory" if kind == "tmp" else "the output it had replaced"
      print(f"[m3jax] removed {path}: {what} left by process {pid}, which is no longer running (an interrupted "
            "convert / export)", file=sys.stderr)
  return tidied


def _sibling(parent: str, base: str, tag: str) -> str:
  return os.path.join(parent, f".{base}{tag}{os.getpid()}-{_HOST_TAG}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_output_dir(dst: str, force: bool = False) -> Iterator[str]:
  """Yields a fresh temporary sibling of ``dst``; on success it is renamed to ``dst`` (replacing an existing
  ``dst`` only with ``force``, and only as ``check_destination`` allows), on any exception (Ctrl-C and SIGTERM
  included) it is deleted. A process killed outright leaves at most a ``.NAME.m3jax-tmp-PID-*`` sibling, never a
  partial ``dst``; the next run into the same parent removes it."""
  dst = os.path.abspath(dst)
  check_destination(dst, force)
  parent, base = os.path.split(dst)
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise CheckpointError(f"{dst}: cannot create its parent directory ({e.strerror})") from None
  tmp, old = _sibling(parent, base, TMP_TAG), None
  try:  # created inside the try: a Ctrl-C right after it exists still removes it
    try:
      os.makedirs(tmp)
    except OSError as e:
      raise CheckpointError(f"{dst}: cannot write in {parent} ({e.strerror})") from None
    yield tmp
    if os.path.lexists(dst):
      check_destination(dst, force, tidy=False)
      old = _sibling(parent, base, OLD_TAG)
      os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
      _remove(old)
  except BaseException:
    with interrupts.deferred():  # a second Ctrl-C does not cut the cleanup short
      if old is not None and os.path.isdir(old) and not os.path.lexists(dst):
        os.rename(old, dst)  # stopped between the two renames: the previous output goes back in place
      _remove(tmp)
    raise


def _remove(path: str, attempts: int = 5) -> None:
  """rmtree that tolerates writer threads still finishing inside ``path``."""
  for i in range(attempts):
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
      return
    time.sleep(0.1 * (i + 1))
