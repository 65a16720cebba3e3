"""The quick tier (``bash scripts/test.sh --quick``, i.e. ``-m quick``) runs at least one test of every test
file, and none of the tests marked ``slow``: read from the test files' source (decorators, ``pytestmark``,
``pytest.param(..., marks=...)``), so that a new test file without a quick test fails here, in the full run."""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def _marks(node: ast.AST) -> set[str]:
  """Names X of every ``pytest.mark.X`` under ``node`` (a decorator, a marks= list, a pytestmark value)."""
  return {n.attr for n in ast.walk(node)
          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def quick_and_slow_tests(path: pathlib.Path) -> tuple[list[str], list[str]]:
  """(tests marked quick, tests marked both quick and slow) of one test file. A module-level ``pytestmark``
  marks every test; a ``pytest.param(..., marks=pytest.mark.quick)`` marks that test (one of its cases)."""
  tree = ast.parse(path.read_text(), str(path))
  module_marks: set[str] = set()
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
      module_marks |= _marks(node.value)
  quick, both = [], []
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
      marks = module_marks | set().union(*(_marks(d) for d in node.decorator_list))
      if "quick" in marks:
        quick.append(node.name)
        if "slow" in marks:
          both.append(node.name)
  return quick, both


@pytest.mark.quick
def test_every_test_file_has_a_quick_test_and_no_quick_test_is_slow():
  files = sorted(TESTS.rglob("test_*.py"))
  assert len(files) > 30, files
  without = [str(f.relative_to(TESTS)) for f in files if not quick_and_slow_tests(f)[0]]
  assert not without, f"test files with no test marked @pytest.mark.quick (scripts/test.sh --quick): {without}"
  slow = {str(f.relative_to(TESTS)): quick_and_slow_tests(f)[1] for f in files}
  assert not any(slow.values()), f"tests marked both quick and slow: { {k: v for k, v in slow.items() if v} }"


@pytest.mark.quick
def test_the_reader_sees_decorators_module_marks_and_params(tmp_path):
  (tmp_path / "test_a.py").write_text(
      "import pytest\n"
      "@pytest.mark.quick\ndef test_one(): pass\n"
      "def test_two(): pass\n"
      "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.quick), 2])\ndef test_three(x): pass\n"
      "@pytest.mark.slow\n@pytest.mark.quick\ndef test_four(): pass\n")
  assert quick_and_slow_tests(tmp_path / "test_a.py") == (["test_one", "test_three", "test_four"], ["test_four"])
  (tmp_path / "test_b.py").write_text("import pytest\npytestmark = [pytest.mark.quick]\ndef test_x(): pass\n")
  assert quick_and_slow_tests(tmp_path / "test_b.py") == (["test_x"], [])
  (tmp_path / "test_c.py").write_text("import pytest\n@pytest.mark.slow\ndef test_y(): pass\n")
  assert quick_and_slow_tests(tmp_path / "test_c.py") == ([], [])
