"""Fetches and prepares the training corpus of the small M3: the King James Bible (public domain), from Debian's
``bible-kjv-text`` data package and ``bible-kjv``'s reader, installed nowhere (``apt-get download`` + ``dpkg -x``
into a temporary directory).

Output: OUT/kjv.txt, one document per chapter ("Genesis 1" then one verse per line, verse numbers dropped),
documents separated by blank lines: 1,189 chapters, about 4.2 MB of UTF-8 text. Deterministic; a completed
OUT/kjv.txt is left alone.

  python scripts/prepare_kjv.py --out data/kjv      # then: m3jax train --data data/kjv/kjv.txt ...

Why this corpus: it is the largest public-domain English text Debian packages as plain data (fortunes is ~3x
smaller, mixed in style and partly of unclear copyright), its language is uniform, and a model of a few million
parameters learns its style well enough to produce readable sentences in minutes of GPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

PACKAGES = ("bible-kjv", "bible-kjv-text")
_HEADING = re.compile(r"^[1-3]?\s?[A-Z][A-Za-z ]+ \d+$")
_VERSE = re.compile(r"^\s+\d+\s+(.*\S)\s*$")  # indented; a heading such as "1 Samuel 3" is not


def extract(workdir: str) -> str:
  """The whole KJV text as the reader prints it (Genesis 1:1 to Revelation 22:21)."""
  for pkg in PACKAGES:
    subprocess.run(["apt-get", "download", pkg], cwd=workdir, check=True, capture_output=True)
  root = os.path.join(workdir, "root")
  for deb in sorted(f for f in os.listdir(workdir) if f.endswith(".deb")):
    subprocess.run(["dpkg", "-x", os.path.join(workdir, deb), root], check=True)
  reader = os.path.join(root, "usr", "bin", "bible")
  # The reader joins -d with its search path (-p): an absolute -d is not found.
  out = subprocess.run([reader, "-p", os.path.join(root, "usr", "lib"), "-d", "bible.data", "-l1000",
                        "gen1:1-rev22:21"], check=True, capture_output=True, stdin=subprocess.DEVNULL)
  return out.stdout.decode("utf-8")


def chapters(text: str) -> list[str]:
  """'Genesis 1' + verse lines per chapter (verse numbers dropped)."""
  docs: list[list[str]] = []
  for line in text.splitlines():
    if not line.strip():
      continue
    verse = _VERSE.match(line)
    if verse and docs:
      docs[-1].append(verse.group(1))
    elif _HEADING.match(line.strip()):
      docs.append([line.strip()])
    else:
      raise ValueError(f"unexpected line in the reader's output: {line!r}")
  return ["\n".join(d) for d in docs]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="data/kjv", help="output directory (default data/kjv)")
  args = ap.parse_args()
  target = os.path.join(args.out, "kjv.txt")
  if os.path.exists(target):
    print(f"{target}: already prepared")
    return 0
  with tempfile.TemporaryDirectory(prefix="m3jax-kjv-") as work:
    docs = chapters(extract(work))
  if len(docs) != 1189:
    print(f"error: expected the 1189 chapters of the KJV, parsed {len(docs)}", file=sys.stderr)
    return 1
  os.makedirs(args.out, exist_ok=True)
  with open(target + ".tmp", "w", encoding="utf-8") as f:
    f.write("\n\n".join(docs) + "\n")
  os.replace(target + ".tmp", target)
  print(f"{target}: {len(docs)} chapters, {os.path.getsize(target):,} bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
