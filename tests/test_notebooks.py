"""The notebooks in notebooks/ execute without error and draw their figures, and are committed without outputs.
Each one's run time is reported against its 3-minute budget (a warning when over it; with -rP or -s, every
notebook's line), not asserted: how fast a machine runs them is no test's verdict.

Each notebook runs in a fresh kernel of *this* interpreter: a kernelspec pointing at sys.executable is written
to a temporary directory put first on JUPYTER_PATH, so the test works from a fresh `pip install -e .[test]` venv
without any `ipykernel install` step. The repository root is put on the kernel's PYTHONPATH, so it also works
from a checkout that is not installed. Execution is discarded; the files are never rewritten.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
BUDGET_S = 180.0           # the limit per notebook (each is written to run in about a minute of CPU): reported
CELL_HANG_S = 600          # a cell still running after this long is stuck (kernel hang), not slow
KERNEL = "hyspec-notebook-test"


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["01_closed_form_vs_serial.ipynb", "02_train_drafter_for_tau.ipynb",
                                           "03_reader_gradients.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"
    assert "widgets" not in nb.metadata


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hyspec-jax notebook test", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")])))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        yield KERNEL


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel_name, record_property):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=CELL_HANG_S,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()            # raises CellExecutionError on the first failing cell (asserts included)
    elapsed = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 1, f"{path.name} drew no figure"
    record_property("seconds", round(elapsed, 1))
    line = f"{path.name} ran in {elapsed:.0f} s (budget {BUDGET_S:.0f} s)"
    print(line)
    if elapsed > BUDGET_S:
        warnings.warn(f"{line}: over its budget", stacklevel=1)
