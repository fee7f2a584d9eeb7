"""The notebooks in notebooks/ run top to bottom without an error.

Each runs in a fresh `python3` kernel (nbclient) with a temporary working directory, so
nothing is written into the repository, and with matplotlib's non-interactive Agg backend.
The kernel imports this checkout's jspec (the repository root goes first on PYTHONPATH).
Their outputs are thrown away: the notebooks are committed without outputs, and a test
checks that they stay so."""
from __future__ import annotations

import os
import time

import pytest

nbformat = pytest.importorskip("nbformat")  # the `test` extra has nbformat, nbclient, ipykernel, matplotlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ["quickstart", "your_own_model", "train_a_head", "inside_one_round"]
CELL_TIMEOUT_S = 300  # one cell; a whole notebook takes well under a minute or two on 2 CPU cores


def _read(name: str):
    return nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)


def test_every_notebook_is_tested_and_committed_without_outputs():
    assert sorted(f[:-len(".ipynb")] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == sorted(NAMES)
    for name in NAMES:
        for cell in _read(name).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name}.ipynb has outputs: clear them"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    nb = _read(name)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    print(f"{name}.ipynb ran in {time.perf_counter() - t0:.1f} s")
