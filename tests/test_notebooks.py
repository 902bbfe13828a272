"""Every notebook under notebooks/ runs top to bottom on the embedded model and draws a figure.

Each notebook runs in a fresh kernel of this interpreter (``sys.executable``), started from a
kernel spec written for the test, with the repository root on ``PYTHONPATH`` so ``import
trace_replay`` finds this checkout whether or not it is installed. The kernel gets
``OMP_NUM_THREADS=1`` unless the caller sets it: on cores shared with other jobs, torch's
OpenMP threads spin against each other (measured on a busy 2-core machine, a bfloat16 replay
took 45 s with 2 threads and 1.7 s with 1). Run times and each notebook's closing findings are
printed (see them with ``pytest -s``); run times are also recorded as the ``wall_s`` property.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient")
pytest.importorskip("ipykernel", reason="notebook tests need ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
KERNEL_NAME = "trace-replay-test"


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> KernelSpecManager:
    """A kernel spec that runs this interpreter, the checkout importable, one OpenMP thread."""
    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / KERNEL_NAME
    spec_dir.mkdir()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "trace_replay tests",
        "language": "python",
        "env": {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(root)])


def test_notebooks_exist():
    """The six notebooks are there (a glob that finds none would run no test at all)."""
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]


def test_committed_without_outputs():
    """Notebooks are committed stripped: no outputs, no execution counts."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name}: a cell has outputs"
                assert cell.execution_count is None, f"{path.name}: a cell has an execution count"


def test_one_imports_cell_and_one_parameters_cell():
    """Each notebook imports in its first code cell only and sets its parameters in the next
    one, tagged "parameters"; of trace_replay it imports the package (and kernels) only."""
    for path in NOTEBOOKS:
        code = [
            cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"
        ]
        importing = [
            i
            for i, cell in enumerate(code)
            if re.search(r"^\s*(import|from) \w", cell.source, re.MULTILINE)
        ]
        assert importing == [0], f"{path.name}: code cells {importing} import"
        tagged = [i for i, cell in enumerate(code) if "parameters" in cell.metadata.get("tags", [])]
        assert tagged == [1], f"{path.name}: code cells {tagged} are tagged parameters"
        used = re.findall(r"^\s*(?:import|from) (trace_replay\S*)", code[0].source, re.MULTILINE)
        assert set(used) <= {"trace_replay", "trace_replay.kernels"}, f"{path.name}: {used}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_specs: KernelSpecManager, record_property):
    """The notebook executes without an error and shows at least one PNG figure."""
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_specs)
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.perf_counter()
    client.execute()
    wall_s = time.perf_counter() - start
    record_property("wall_s", round(wall_s, 1))
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    findings = "".join(
        out.get("text", "")
        for out in code_cells[-1].outputs
        if out.output_type == "stream" and out.name == "stdout"
    )
    print(f"\n{path.name}: {wall_s:.0f} s\n{findings}")

    outputs = [out for cell in code_cells for out in cell.outputs]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    assert any("image/png" in out.get("data", {}) for out in outputs), f"{path.name}: no figure"
