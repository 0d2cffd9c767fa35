"""Every notebook under notebooks/ runs top to bottom without an error, and git holds them stripped.

Each notebook runs in a fresh kernel on this interpreter: the test writes a kernelspec that
names ``sys.executable`` into a temporary JUPYTER_PATH, so the kernel is the venv's Python
(with hybrid_jax installed) whatever kernels the machine has registered. Matplotlib draws with
the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

TESTS = Path(__file__).resolve().parent
NOTEBOOKS = TESTS.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL = "hybrid-jax-test"
# A notebook is written to run in well under two minutes on one laptop core; the margin is for
# CI, where two test processes share two cores. The limit covers kernel start and every cell.
NOTEBOOK_TIMEOUT_S = 360


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec for this interpreter, found first, and per-test IPython/runtime dirs."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
        "env": {"MPLBACKEND": "Agg"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    # No user profile in the kernel; one startup file: the suite's JAX speed-ups.
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-jax-speedups.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        f"import _jax_speedups\n_jax_speedups.apply()\nsys.path.remove({str(TESTS)!r})\n"
    )
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MPLBACKEND", "Agg")


def test_notebooks_exist():
    # An empty glob would parametrize the tests below away and pass silently.
    assert PATHS, f"no notebooks under {NOTEBOOKS}"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_runs_without_error(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S

    def remaining(cell=None) -> int:
        # nbclient reads 0 as "no limit": never hand it less than one second.
        return max(1, int(deadline - time.monotonic()))

    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=NOTEBOOK_TIMEOUT_S,
        timeout_func=remaining,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    errors = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors, f"{path.name}: {errors}"
    assert client.code_cells_executed == sum(cell.cell_type == "code" for cell in nb.cells)


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs or execution counts; "
        f"run `python tools/strip_notebooks.py {path.relative_to(NOTEBOOKS.parent)}`"
    )


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_opens_with_what_it_shows_and_ends_with_where_to_go_next(path):
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# "), path.name
    assert last.cell_type == "markdown" and "where to go next" in last.source.lower(), path.name
