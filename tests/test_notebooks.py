"""Research notebooks: each one executes without error, is committed without outputs, and its jupytext .py
pair is in sync."""

import os
import pathlib

import jupytext
import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
REPO = str(pathlib.Path(__file__).parent.parent)


@pytest.mark.quick
def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
@pytest.mark.quick
def test_committed_without_outputs_and_paired(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs before committing"
  paired = jupytext.read(path.with_suffix(".py"))
  assert [c.source for c in paired.cells] == [c.source for c in nb.cells], f"{path.name} and its .py differ"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
