"""Options shared by the commands that generate (``generate``, ``chat``, ``serve``, ``batch``): the stop tokens
(``--eos-ids``, or the checkpoint's own, with the ones the model can never produce dropped) and the checks on the
sampling and size options that can run before the model is loaded."""

from __future__ import annotations

import argparse
import os
import sys

from m3jax.token_ids import check_in_vocab, parse_token_ids

_INT32_MAX = 2**31 - 1


def add_eos_argument(p: argparse.ArgumentParser) -> None:
  p.add_argument("--eos-ids", default=None, metavar="IDS",
                 help="comma-separated stop token ids, replacing the checkpoint's (config.json and "
                      "generation_config.json eos_token_id); an empty string: never stop early")


def stop_ids(args: argparse.Namespace, checkpoint: str, config_eos: tuple[int, ...], vocab_size: int
             ) -> tuple[int, ...]:
  """The stop tokens of a generating command: ``--eos-ids`` when given (each must lie in the vocabulary), else
  the config's eos ids then generation_config.json's, without repeats. An id of the checkpoint's outside
  [0, vocab_size) can never be generated: it is dropped with a warning naming the file it came from (HF-made
  checkpoints of small test models often keep the full model's eos id)."""
  from m3jax import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top

  if getattr(args, "eos_ids", None) is not None:
    ids = parse_token_ids(args.eos_ids, "--eos-ids") if args.eos_ids.strip() else []
    check_in_vocab(ids, vocab_size, "--eos-ids")
    return tuple(dict.fromkeys(ids))
  sources = ((os.path.join(checkpoint, "config.json"), tuple(config_eos)),
             (os.path.join(checkpoint, "generation_config.json"), tok_lib.generation_eos_ids(checkpoint)))
  kept = []
  for file, ids in sources:
    for t in ids:
      if 0 <= t < vocab_size:
        kept.append(t)
      else:
        print(f"[m3jax] warning: {file}: eos_token_id {t} is outside the vocabulary [0, {vocab_size}), so the "
              "model can never produce it; ignored (--eos-ids sets the stop tokens)", file=sys.stderr)
  return tuple(dict.fromkeys(kept))


def check_sampling_args(args: argparse.Namespace) -> None:
  """--temperature / --top-k / --top-p / --seed (and --steps-per-call, --prefill-chunk, --max-new-tokens where
  the command has them), checked before the model loads: ValueError naming the option."""
  from m3jax.generate import check_prefill_chunk  # pylint: disable=g-import-not-at-top
  from m3jax.sampling import SamplingParams  # pylint: disable=g-import-not-at-top

  try:
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  except ValueError as e:
    raise ValueError(f"sampling options: {e}") from None
  if not 0 <= args.seed <= _INT32_MAX:
    raise ValueError(f"--seed must be in [0, {_INT32_MAX}], got {args.seed}")
  for option in ("steps_per_call", "max_new_tokens", "slots", "batch_size"):
    value = getattr(args, option, None)
    if value is not None and not 1 <= value <= _INT32_MAX:
      raise ValueError(f"--{option.replace('_', '-')} must be in [1, {_INT32_MAX}], got {value}")
  max_length = getattr(args, "max_length", None)
  if max_length is not None and not 2 <= max_length <= _INT32_MAX:
    raise ValueError(f"--max-length must be in [2, {_INT32_MAX}], got {max_length}")
  try:
    check_prefill_chunk(getattr(args, "prefill_chunk", None))
  except ValueError as e:
    raise ValueError(f"--prefill-chunk: {e}") from None
