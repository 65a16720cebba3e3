"""The import graph of m3jax and pallas_kernels has no circle.

Every import statement counts, including those inside functions (a function-level import is still an edge: it
only hides the circle until that function runs); imports under ``if TYPE_CHECKING:`` do not, since they never
run. The graph is grimp's (it reads the source, nothing is imported); a circle is a strongly connected
component of more than one module, or a module that imports itself.
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("m3jax", "pallas_kernels")


def import_graph() -> grimp.ImportGraph:
  return grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)


def strongly_connected_components(graph: grimp.ImportGraph) -> list[list[str]]:
  """Tarjan's algorithm (iterative): every strongly connected component of the module graph, members sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[list[str]] = []
  for root in sorted(graph.modules):
    if root in index:
      continue
    work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      module, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
        elif child in on_stack:
          low[module] = min(low[module], index[child])
        continue
      work.pop()
      if work:
        parent = work[-1][0]
        low[parent] = min(low[parent], low[module])
      if low[module] == index[module]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == module:
            break
        components.append(sorted(component))
  return components


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
  """The components that are circles (more than one module, or a module importing itself)."""
  return [c for c in strongly_connected_components(graph)
          if len(c) > 1 or c[0] in graph.find_modules_directly_imported_by(c[0])]


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
  """One circle: its modules, and every import between two of them with its line numbers."""
  members = set(cycle)
  lines = [f"{len(cycle)} modules in one import circle: {', '.join(cycle)}"]
  for importer in cycle:
    for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
      where = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
      lines.append(f"  {importer} -> {imported} (line {', '.join(map(str, where))})")
  return "\n".join(lines)


@pytest.mark.quick
def test_tarjan_finds_a_circle_and_nothing_else():
  graph = grimp.ImportGraph()
  for module in ("p", "p.a", "p.b", "p.c", "p.d"):
    graph.add_module(module)
  graph.add_import(importer="p.a", imported="p.b")
  graph.add_import(importer="p.b", imported="p.c")
  graph.add_import(importer="p.c", imported="p.a")
  graph.add_import(importer="p.c", imported="p.d")
  assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
  graph.remove_import(importer="p.c", imported="p.a")
  assert import_cycles(graph) == []


@pytest.mark.quick
def test_no_import_circle_in_m3jax_or_pallas_kernels():
  graph = import_graph()
  assert "m3jax.checkpoint.loader" in graph.modules and "pallas_kernels.moe" in graph.modules
  assert "m3jax.checkpoint.loader" not in graph.find_modules_directly_imported_by("m3jax.sharding")
  cycles = import_cycles(graph)
  assert not cycles, "import circles (function-level imports count):\n" + "\n".join(
      describe(graph, c) for c in cycles)


WEB_STACK = ("fastapi", "starlette", "uvicorn", "pydantic")  # the `serve` extra: not on the GPU machines
SERVE_ONLY = ("m3jax.serving_app", "m3jax.serving_http", "m3jax.serving_replies", "m3jax.serving_schema",
              "m3jax.commands.serve")


@pytest.mark.quick
def test_only_the_http_server_imports_the_web_stack():
  """The engine, the serving core and everything the GPU scripts import run without FastAPI / uvicorn installed:
  only the HTTP server's modules (imported by ``m3jax serve`` alone) reach them, function-level imports included."""
  graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True,
                            include_external_packages=True)
  assert graph.chain_exists(importer="m3jax.commands.serve", imported="uvicorn")
  reach = sorted(f"{m} -> {w}" for m in graph.modules if m.startswith(PACKAGES) and m not in SERVE_ONLY
                 for w in WEB_STACK if w in graph.modules and graph.chain_exists(importer=m, imported=w))
  assert not reach, reach
