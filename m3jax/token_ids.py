"""Checks on the token ids a caller hands in (prompts and stop tokens), so that a float, a bool or an id outside
the vocabulary fails at once with a message naming it, instead of being truncated by ``int()`` or a numpy cast
(1.7 -> 1) or never matching (a stop id the model cannot produce)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


def is_token_id(value: object) -> bool:
  """True for Python / numpy integers and 0-d integer arrays (not bools, which ``int()`` would take as 0 / 1)."""
  if isinstance(value, (bool, np.bool_)):
    return False
  if isinstance(value, (numbers.Integral, np.integer)):
    return True
  dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
  return dtype is not None and shape == () and np.issubdtype(dtype, np.integer)


def check_count(value: object, what: str, minimum: int = 1) -> int:
  """A count such as max_new_tokens: an integer (Python or numpy, not a bool or a float like 2.5 or 2.0) >= minimum
  -> int; raises ValueError naming ``what`` otherwise."""
  if not is_token_id(value):
    raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
  if int(value) < minimum:
    raise ValueError(f"{what} must be >= {minimum}, got {value}")
  return int(value)


def check_no_placeholders(ids: Sequence[int] | np.ndarray, placeholder_ids: Sequence[int], what: str) -> None:
  """Raises ValueError naming ``what`` when ``ids`` hold an image / video placeholder token: the model would embed
  it as an ordinary token, but it stands for image features nobody gave."""
  if not len(placeholder_ids):
    return
  found = sorted(set(np.asarray(ids).ravel().tolist()) & {int(t) for t in placeholder_ids})
  if found:
    raise ValueError(f"{what} hold image / video placeholder tokens {found} but no image or video was given (pass "
                     "the images, e.g. --image, or remove the placeholders)")


def token_list(ids: Sequence[int] | np.ndarray, what: str) -> list[int]:
  """A 1-D sequence of integer ids -> list[int]; raises ValueError naming ``what`` on a non-integer entry."""
  if isinstance(ids, (str, bytes)):
    raise ValueError(f"{what}: expected token ids, got a {type(ids).__name__} (tokenize it first)")
  if isinstance(ids, np.ndarray) or hasattr(ids, "dtype"):
    arr = np.asarray(ids)
    if arr.ndim != 1:
      raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    return arr.tolist()
  out = []
  for j, t in enumerate(ids):
    if not is_token_id(t):
      raise ValueError(f"{what}: token ids must be integers, got {t!r} ({type(t).__name__}) at index {j}")
    out.append(int(t))
  return out


def check_in_vocab(ids: Sequence[int], vocab_size: int, what: str) -> None:
  """Raises ValueError naming ``what`` when an id lies outside [0, vocab_size)."""
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"{what} outside [0, {vocab_size}): {bad[:8]}{' ...' if len(bad) > 8 else ''}")


def resolve_stop_ids(eos_token_ids: Sequence[int] | None, default: Sequence[int], vocab_size: int) -> tuple[int, ...]:
  """The stop tokens of a generation call: ``default`` (the config's eos ids) when None, else the given ids,
  checked to be integers the model can produce (an id outside the vocabulary would never stop anything)."""
  if eos_token_ids is None:
    return tuple(int(t) for t in default)
  if is_token_id(eos_token_ids):
    raise ValueError(f"eos_token_ids must be a sequence of ids, got the single id {eos_token_ids!r}; "
                     f"write [{eos_token_ids}]")
  ids = token_list(eos_token_ids, "eos_token_ids")
  check_in_vocab(ids, vocab_size, "eos_token_ids")
  return tuple(ids)


def parse_token_ids(text: str, option: str = "--prompt-ids") -> list[int]:
  """'1, 2,3' -> [1, 2, 3] (a command-line list); raises ValueError naming ``option`` and the bad entry on an
  empty entry ('1,,2') or one that is not a decimal integer."""
  ids = []
  for j, part in enumerate(text.split(",")):
    part = part.strip()
    if not part.lstrip("-").isdigit():
      raise ValueError(f"{option}: entry {j} is {part!r}; expected comma-separated integer token ids, got {text!r:.80}")
    ids.append(int(part))
  return ids
