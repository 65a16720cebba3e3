"""Walks traced and compiled programs for the decode-loop tests: which array concatenations run inside a while
loop (jaxprs) and which compiled HLO computations a while body reaches."""

from __future__ import annotations

import re
from collections.abc import Callable


def concatenates(jaxpr, match: Callable[[object], bool], in_loop: bool = False) -> list[tuple[object, bool]]:
  """(output aval, inside a while body?) of every concatenate whose output aval ``match``es, nested jaxprs (jit,
  pallas, shard_map, loops, branches) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "concatenate" and match(eqn.outvars[0].aval):
      found.append((eqn.outvars[0].aval, in_loop))
    for name, value in eqn.params.items():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += concatenates(sub, match, in_loop or (eqn.primitive.name == "while" and name == "body_jaxpr"))
  return found


def hlo_computations(hlo_text: str) -> dict[str, str]:
  """Compiled HLO text -> {computation name: its text}."""
  comps = {}
  for block in hlo_text.split("\n\n"):
    head = block.strip().split("\n", 1)[0]
    name = head.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
    if name:
      comps[name] = block
  return comps


def loop_body_computations(hlo_text: str, comps: dict[str, str]) -> set[str]:
  """Names of the computations reachable (fusions, nested loops, branches) from any while body of the program."""
  seen, todo = set(), list(set(re.findall(r"body=%([\w.\-]+)", hlo_text)))
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo += re.findall(r"%([\w.\-]+)", " ".join(re.findall(
        r"(?:calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|%[\w.\-]+)", comps[name])))
  return seen
