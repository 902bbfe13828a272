"""Execute every notebook on CPU and save its key figure as ``docs/gallery/<notebook>.png``.

The README's gallery shows these, so a reader sees results before installing anything. Each
notebook runs top to bottom in a fresh kernel of this interpreter (the checkout on
``PYTHONPATH``, one OpenMP thread, as ``tests/test_notebooks.py`` runs them); the key figure
is the first PNG drawn by the code cell whose source contains the notebook's entry in
``KEY_CELLS`` (else the notebook's last PNG). Notebooks themselves stay without outputs.

Usage::

    python docs/make_gallery.py                  # all notebooks
    python docs/make_gallery.py 02_dataset_divergence
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "gallery"
# notebook stem -> text in the source of the cell that draws its key figure
KEY_CELLS = {
    "01_quickstart": "plot_trace(",
    "02_dataset_divergence": "plot_rank_buckets(",
    "03_engines_and_precision": "plot_divergence_heatmap(",
    "04_speculative_verify": "speedup",
    "05_explorer": "plot_divergence_heatmap(",
    "06_where_divergence_comes_from": "plot_layer_divergence(",
}


def _kernel_specs(root: Path) -> KernelSpecManager:
    spec_dir = root / "trace-replay-gallery"
    spec_dir.mkdir()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "trace_replay gallery",
        "language": "python",
        "env": {
            "PYTHONPATH": path,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "CUDA_VISIBLE_DEVICES": "",
        },
    }  # the gallery shows CPU runs
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(root)])


def key_figure(nb, key: str | None) -> bytes:
    """The PNG of the key cell (first image it drew), else the notebook's last PNG."""
    pngs = [
        (cell, out["data"]["image/png"])
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]
    if not pngs:
        raise RuntimeError("the notebook drew no figure")
    chosen = next((png for cell, png in pngs if key and key in cell.source), pngs[-1][1])
    return base64.b64decode(chosen)


def run(path: Path, specs: KernelSpecManager) -> Path:
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="trace-replay-gallery", kernel_spec_manager=specs)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb,
        km=km,
        timeout=900,
        kernel_name="trace-replay-gallery",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    out = OUT / f"{path.stem}.png"
    out.write_bytes(key_figure(nb, KEY_CELLS.get(path.stem)))
    last = [cell for cell in nb.cells if cell.cell_type == "code"][-1]
    findings = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    print(
        f"{path.name}: {time.perf_counter() - start:.0f} s -> {out.relative_to(ROOT)}\n{findings}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebook stems (default: all)")
    args = parser.parse_args()
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.notebooks:
        paths = [p for p in paths if p.stem in args.notebooks]
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = _kernel_specs(Path(tmp))
        for path in paths:
            run(path, specs)


if __name__ == "__main__":
    main()
