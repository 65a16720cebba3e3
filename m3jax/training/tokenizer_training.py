"""A byte-level BPE tokenizer trained on the corpus, saved as a checkpoint's tokenizer files (tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json), like the built-in demo's (m3jax/demo.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from m3jax.demo import CHAT_TEMPLATE, SPECIAL_TOKENS, VISION_TOKENS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def train_bpe(documents: Sequence[str], vocab_size: int) -> Tokenizer:
  """Byte-level BPE with at most ``vocab_size`` entries (the special and vision tokens first, then the 256 byte
  symbols, then merges); deterministic for a given corpus."""
  reserved = len(SPECIAL_TOKENS) + len(VISION_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
  if vocab_size <= reserved:
    raise ValueError(f"vocab_size {vocab_size} leaves no room for BPE merges: the special tokens and byte alphabet "
                     f"take {reserved}")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + VISION_TOKENS,
                                show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(documents, trainer=trainer)
  return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
  """{'pad', 'bos', 'eos', 'image', 'video'} -> token id."""
  names = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "image": VISION_TOKENS[0], "video": VISION_TOKENS[1]}
  return {k: tok.token_to_id(v) for k, v in names.items()}


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike) -> None:
  """Writes TOKENIZER_FILES to ``out_dir`` (created if needed)."""
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  ids = special_ids(tok)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE},
              f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"]]}, f, indent=2)
