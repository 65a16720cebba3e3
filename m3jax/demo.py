"""The built-in demo: the small trained M3 when the package carries it (``trained_demo_checkpoint``), else a tiny
M3 checkpoint (original MiniMax layout, deterministic random weights, a small BPE tokenizer trained on bundled
text) that exercises the whole pipeline end to end."""

from __future__ import annotations

import json
import os
from importlib import resources

import jax.numpy as jnp
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from m3jax import config as m3config
from m3jax.checkpoint.writer import write_checkpoint
from m3jax.model import M3ForCausalLM

# Where the small trained M3 lives inside the package (scripts/train_small.sh makes it; an m3jax checkpoint).
TRAINED_DEMO = "assets/m3-small-kjv"
TRAINED_DEMO_PROMPT = "And God said"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>"]
# M3's vision markers (the placeholder, video placeholder, and the image start / end tokens).
VISION_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def trained_demo_checkpoint() -> str | None:
  """The packaged small trained M3 (a complete m3jax checkpoint at m3jax/TRAINED_DEMO), or None without one."""
  from m3jax.checkpoint.converted import is_converted  # pylint: disable=g-import-not-at-top

  path = os.fspath(resources.files("m3jax").joinpath(TRAINED_DEMO))
  return path if is_converted(path) else None


def train_demo_tokenizer(vocab_size: int = 384) -> Tokenizer:
  """Byte-level BPE trained on m3jax/assets/demo_corpus.txt (deterministic)."""
  text = resources.files("m3jax").joinpath("assets/demo_corpus.txt").read_text()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + VISION_TOKENS,
                                show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(text.splitlines(), trainer=trainer)
  return tok


def build_demo_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0) -> str:
  """Writes config.json, safetensors (original layout, text + a tiny vision tower + one MTP module), tokenizer and
  generation files to ``out_dir``."""
  out_dir = os.fspath(out_dir)
  tok = train_demo_tokenizer()
  base = m3config.tiny(block_size=16)
  eos, bos = tok.token_to_id("<eos>"), tok.token_to_id("<bos>")
  text = base.text.__class__(**{**base.text.__dict__, "vocab_size": tok.get_vocab_size(), "bos_token_id": bos,
                                "eos_token_ids": (eos,), "num_mtp_modules": 1})
  with_vision = m3config.tiny(block_size=16, vision=True)
  cfg = m3config.M3Config(text=text, vision=with_vision.vision, projector_hidden_size=text.hidden_size,
                          image_token_id=tok.token_to_id(VISION_TOKENS[0]),
                          video_token_id=tok.token_to_id(VISION_TOKENS[1]))
  model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed), with_vision=True, with_mtp=True)
  write_checkpoint(model, out_dir, layout="original")
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE},
              f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": bos, "eos_token_id": [eos]}, f, indent=2)
  return out_dir
