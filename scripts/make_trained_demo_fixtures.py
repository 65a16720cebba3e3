"""Writes the fixtures that pin the small trained M3 (m3jax/assets/m3-small-kjv) in CI, where the corpus is absent:

  tests/fixtures/m3_small_kjv/words.txt          every word of the corpus (lowercase a-z runs), one per line
  tests/fixtures/m3_small_kjv/continuations.json five fixed prompts and the model's greedy continuations (token ids
                                                 and text, on the reference ops on the CPU)

  python scripts/prepare_kjv.py --out data/kjv   # where Debian's archive is reachable
  JAX_PLATFORMS=cpu python scripts/make_trained_demo_fixtures.py --corpus data/kjv/kjv.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re

PROMPTS = ("And God said", "In the beginning", "The LORD is my shepherd", "Blessed are the",
           "And it came to pass")
NEW_TOKENS = 32
WORD = re.compile(r"[a-z]+")


def corpus_words(text: str) -> list[str]:
  """The sorted distinct words of a text: runs of a-z after lowercasing."""
  return sorted(set(WORD.findall(text.lower())))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--corpus", required=True)
  ap.add_argument("--model", default=None, help="default: the packaged trained demo")
  ap.add_argument("--out", default="tests/fixtures/m3_small_kjv")
  args = ap.parse_args()

  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax.demo import trained_demo_checkpoint  # pylint: disable=g-import-not-at-top
  from m3jax.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top

  path = args.model or trained_demo_checkpoint()
  if path is None:
    raise SystemExit("no trained demo checkpoint in the package (m3jax/assets/m3-small-kjv); pass --model")
  os.makedirs(args.out, exist_ok=True)
  with open(args.corpus, encoding="utf-8") as f:
    words = corpus_words(f.read())
  with open(os.path.join(args.out, "words.txt"), "w") as f:
    f.write("\n".join(words) + "\n")

  model = m3jax.load(path, kernels="reference")
  tok = load_tokenizer(path)
  rows = []
  for prompt in PROMPTS:
    ids = tok.encode(prompt).ids
    out = m3jax.generate(model, [ids], max_new_tokens=NEW_TOKENS)
    new = out.tokens[0, : out.lengths[0]].tolist()
    rows.append({"prompt": prompt, "prompt_ids": ids, "tokens": new, "text": tok.decode(new)})
    print(f"{prompt!r} -> {tok.decode(new)!r}")
  with open(os.path.join(args.out, "continuations.json"), "w") as f:
    json.dump({"max_new_tokens": NEW_TOKENS, "continuations": rows}, f, indent=1)
  print(f"{len(words)} corpus words; {len(rows)} continuations -> {args.out}")


if __name__ == "__main__":
  main()
