"""The documentation is checked like code: README.md, BENCHMARKS.md, CONTRIBUTING.md (when present) and docs/*.md.

* every relative link resolves: the file (or directory) exists, and a ``#anchor`` names a heading of the target
  (GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats);
* every ```python block parses, and its import statements import (run in this process: cheap, jax is loaded);
* every ``m3jax <subcommand>`` shown in code (fenced blocks and inline code spans) is a subcommand of
  ``m3jax.cli``, every ``--flag`` after it is one of that subcommand's options, and its ``--help`` runs (through
  the argparse parser, in this process);
* every repository path named (``scripts/*.py``, ``tests/...``, ``m3jax/...``, ``notebooks/...``, ...) exists.

Pure text parsing plus one argparse parser: a few seconds in all.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import glob
import io
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
HISTORY = REPO / "docs" / "benchmarks-history.md"


def doc_files() -> list[pathlib.Path]:
  files = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
  return [f for f in files if f.exists()]


@dataclasses.dataclass(frozen=True)
class Block:
  """A fenced code block: its info string's language, its text and the line of its first text line."""

  language: str
  text: str
  line: int


@dataclasses.dataclass
class Doc:
  """A markdown file split into prose lines (code blocks blanked out, line numbers kept) and fenced blocks."""

  path: pathlib.Path
  prose: list[str]
  blocks: list[Block]

  @property
  def name(self) -> str:
    return _rel(self.path)


def _rel(path: pathlib.Path) -> str:
  return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def parse(path: pathlib.Path) -> Doc:
  prose, blocks = [], []
  fence, language, body, start = None, "", [], 0
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    m = _FENCE.match(line)
    if fence is None and m:
      fence, language, body, start = m.group(1), m.group(2).lower(), [], number + 1
      prose.append("")
    elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
      blocks.append(Block(language, "\n".join(body), start))
      fence = None
      prose.append("")
    elif fence is not None:
      body.append(line)
      prose.append("")
    else:
      prose.append(line)
  assert fence is None, f"{path}: a fenced code block opened at line {start - 1} is never closed"
  return Doc(path, prose, blocks)


DOCS = {f: parse(f) for f in doc_files()}


def _doc(path: pathlib.Path) -> Doc:
  if path not in DOCS:
    DOCS[path] = parse(path)
  return DOCS[path]


# ------------------------------------------------------------------------------------------------------ links

_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")


def slug(heading: str) -> str:
  """GitHub's id for a heading's text (inline markup reduced to its text first)."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
  text = text.replace("`", "").replace("*", "")
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """The ids of every heading of a markdown file (repeats get -1, -2, ...)."""
  seen: dict[str, int] = {}
  out = set()
  for line in _doc(path).prose:
    m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    base = slug(m.group(1))
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


def links(doc: Doc) -> list[tuple[int, str]]:
  """(line, target) of every inline link, image and reference definition outside code."""
  out = []
  for number, line in enumerate(doc.prose, 1):
    text = _INLINE_CODE.sub("", line)
    out += [(number, m.group(1)) for m in _LINK.finditer(text)]
    m = _REFERENCE.match(text)
    if m:
      out.append((number, m.group(1)))
  return out


def broken_links(doc: Doc) -> list[str]:
  problems = []
  for number, target in links(doc):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
      continue
    file_part, _, anchor = target.partition("#")
    where = f"{doc.name}:{number}: link {target!r}"
    path = doc.path if not file_part else (doc.path.parent / file_part).resolve()
    if not path.exists():
      problems.append(f"{where}: {file_part} does not exist")
    elif anchor and path.suffix == ".md" and anchor not in anchors(path):
      problems.append(f"{where}: {_rel(path)} has no heading with id #{anchor}")
    elif anchor and path.suffix != ".md":
      problems.append(f"{where}: an anchor into a file that is not markdown")
  return problems


@pytest.mark.quick
@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
  problems = broken_links(DOCS[path])
  assert not problems, "\n".join(problems)


def test_the_docs_link_each_other():
  """README reaches every guide (directly or through docs/index.md), and docs/index.md lists every guide."""
  guides = {p for p in DOCS if p.parent == REPO / "docs"}
  index = REPO / "docs" / "index.md"
  assert index in guides, "docs/index.md is missing"
  listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(DOCS[index]) if not t.startswith("#")}
  assert guides - {index} <= listed, f"not linked from docs/index.md: {sorted(str(g) for g in guides - listed - {index})}"
  readme = {(REPO / t.partition("#")[0]).resolve() for _, t in links(DOCS[REPO / "README.md"])}
  assert index in readme and REPO / "BENCHMARKS.md" in readme


# ------------------------------------------------------------------------------------------- python imports


def python_blocks() -> list[tuple[str, Block]]:
  return [(doc.name, b) for doc in DOCS.values() for b in doc.blocks if b.language in ("python", "py")]


def test_python_blocks_parse_and_their_imports_import():
  problems = []
  done: set[str] = set()
  for name, block in python_blocks():
    try:
      tree = ast.parse(block.text)
    except SyntaxError as e:
      problems.append(f"{name}:{block.line + (e.lineno or 1) - 1}: not valid Python: {e.msg}")
      continue
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      statement = ast.unparse(node)
      if statement in done:
        continue
      done.add(statement)
      try:
        exec(compile(ast.Module([node], type_ignores=[]), name, "exec"), {})  # pylint: disable=exec-used
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"{name}:{block.line + node.lineno - 1}: {statement!r} fails: {type(e).__name__}: {e}")
  assert python_blocks(), "no python code block found"
  assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------ CLI commands

_COMMAND = re.compile(r"(?:^|(?<=[\s/(]))m3jax\s+([a-z][a-z0-9_-]*)(.*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclasses.dataclass(frozen=True)
class Command:
  where: str
  subcommand: str
  flags: tuple[str, ...]


def _commands_in(text: str, where: str) -> list[Command]:
  out = []
  for segment in re.split(r"&&|\|\||;|\s\|\s", re.sub(r"(^|\s)#\s.*$", "", text)):
    m = _COMMAND.search(segment)
    if m:
      out.append(Command(where, m.group(1), tuple(_FLAG.findall(m.group(2)))))
  return out


def commands(docs: list[Doc] | None = None) -> list[Command]:
  """Every ``m3jax <subcommand> [--flags]`` of the docs' code: fenced blocks (backslash continuations joined) and
  inline code spans."""
  out = []
  for doc in DOCS.values() if docs is None else docs:
    for block in doc.blocks:
      if block.language in ("python", "py", "json"):
        continue
      logical, first = "", block.line
      for offset, line in enumerate(block.text.splitlines()):
        if not logical:
          first = block.line + offset
        if line.rstrip().endswith("\\"):
          logical += line.rstrip()[:-1] + " "
          continue
        out += _commands_in(logical + line, f"{doc.name}:{first}")
        logical = ""
    for number, line in enumerate(doc.prose, 1):
      for m in _INLINE_CODE.finditer(line):
        out += _commands_in(m.group(2), f"{doc.name}:{number}")
  return out


def subparsers() -> dict[str, argparse.ArgumentParser]:
  from m3jax import cli  # pylint: disable=g-import-not-at-top

  parser = cli.build_parser()
  (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # pylint: disable=protected-access
  return dict(action.choices)


@pytest.mark.quick
def test_every_command_shown_exists_with_its_flags_and_its_help_runs():
  parsers = subparsers()
  found = commands()
  assert {c.subcommand for c in found} >= {"demo", "generate"}, "the docs show no m3jax command"
  problems = []
  for c in found:
    if c.subcommand not in parsers:
      problems.append(f"{c.where}: `m3jax {c.subcommand}` is not a subcommand (they are {sorted(parsers)})")
      continue
    options = parsers[c.subcommand]._option_string_actions  # pylint: disable=protected-access
    problems += [f"{c.where}: `m3jax {c.subcommand}` has no option {f}" for f in c.flags if f not in options]
  for name in sorted({c.subcommand for c in found} & set(parsers)):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
      parsers[name].parse_args(["--help"])
    if exit_info.value.code != 0 or f"m3jax {name}" not in out.getvalue():
      problems.append(f"`m3jax {name} --help` exited {exit_info.value.code}: {out.getvalue()[:200]!r}")
  assert not problems, "\n".join(problems)


@pytest.mark.quick
def test_every_subcommand_is_documented():
  shown = {c.subcommand for c in commands() if c.where.startswith(("README.md", "docs/"))}
  assert not set(subparsers()) - shown, f"subcommands no doc shows: {sorted(set(subparsers()) - shown)}"


# -------------------------------------------------------------------------------------------- repository paths

_PATH = re.compile(r"(?<![\w./$-])((?:scripts|tests|notebooks|m3jax|pallas_kernels|docs)/[\w./*-]*[\w*])")


def named_paths(doc: Doc) -> list[tuple[str, str]]:
  """(where, path) of every repository path a doc names, in prose or code."""
  out = []
  for number, line in enumerate(doc.prose, 1):
    out += [(f"{doc.name}:{number}", m.group(1)) for m in _PATH.finditer(line)]
  for block in doc.blocks:
    for offset, line in enumerate(block.text.splitlines()):
      out += [(f"{doc.name}:{block.line + offset}", m.group(1)) for m in _PATH.finditer(line)]
  return out


@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_exist(path):
  doc = DOCS[path]
  problems = []
  for where, name in named_paths(doc):
    # The history records files that later sessions removed or renamed; of those it must still name real
    # scripts (the commands it quotes), nothing else is checked there.
    if path == HISTORY and not name.startswith("scripts/"):
      continue
    if not glob.glob(str(REPO / name)):
      problems.append(f"{where}: {name} does not exist")
  assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_check(tmp_path):
  """The parsing above finds a broken link, a missing anchor, an unknown flag and a missing path."""
  page = tmp_path / "page.md"
  page.write_text("# A title\n\nSee [b](missing.md), [c](#a-title), [d](#no-such), [e](https://x.org/y).\n\n"
                  "```bash\nm3jax generate CKPT \\\n  --no-such-flag  # m3jax nothing\n```\n\nRun `scripts/nope.py`.\n")
  doc = parse(page)
  problems = broken_links(doc)
  assert len(problems) == 2 and "missing.md does not exist" in problems[0] and "#no-such" in problems[1], problems
  assert slug("`m3jax serve`: OpenAI-compatible (v1) API!") == "m3jax-serve-openai-compatible-v1-api"
  assert _commands_in("m3jax generate CKPT --no-such-flag  # m3jax nothing", "x") == [
      Command("x", "generate", ("--no-such-flag",))]
  assert [(c.subcommand, c.flags) for c in commands([doc])] == [("generate", ("--no-such-flag",))]
  assert [p for _, p in named_paths(doc)] == ["scripts/nope.py"]
