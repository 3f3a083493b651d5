"""Every notebook in notebooks/ runs top to bottom in a real kernel, and is committed clean."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# 04_tpu needs torch_xla: it runs in the torch_xla environment (tests/run_xla.sh); 07_ray_cluster
# starts Ray, which runs only in a loopback-only network namespace (tests/ray/test_notebook.py).
MAIN_SUITE = [nb for nb in NOTEBOOKS if "tpu" not in nb.stem and "ray" not in nb.stem]
# What a reader must see in a notebook's outputs for it to have shown what it says it shows.
EXPECTED = {
    "01_quickstart": ["[rank1]: worker 1 of 2 on cpu", "[rank0]: epoch 20: loss", "evaluated 512 samples (of 512)",
                      "caught: bad batch on rank 1 | root cause rank: 1"],
    "02_training": ["128 records in the notebook", "TensorBoard: 128 loss points in runs/blobs",
                    "resumed run matches the original exactly", "301 predictions gathered",
                    "background run finished: 128 records"],
    "06_warm_workers": ["2 warm workers (fork), alive", "model, optimizer", "trained 40 steps in two cells",
                        "caught: RuntimeError", "still here: DistributedDataParallel", "nbaccel: warm workers stopped"],
}
# Figures a worker draws must be in the saved notebook, as images.
EXPECTED_IMAGES = {"01_quickstart": 1}


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; strip them before committing"


def _execute(path: Path, folder: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    return nb


def _temp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


@pytest.mark.slow
@pytest.mark.parametrize("path", MAIN_SUITE, ids=[p.stem for p in MAIN_SUITE])
def test_notebook_runs_twice_in_a_real_kernel_and_leaves_its_folder_as_it_was(path, monkeypatch, tmp_path):
    """Run All, twice, in the same folder (as a user does): both runs show the same, nothing is left behind."""
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.chdir(tmp_path)
    temp_before = _temp_entries()
    for run in (1, 2):
        nb = _execute(path, tmp_path)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors
        shown = _text(nb)
        missing = [text for text in EXPECTED.get(path.stem, []) if text not in shown]
        assert not missing, f"{path.name}, run {run}: outputs lack {missing}"
        images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) == EXPECTED_IMAGES.get(path.stem, len(images)), f"{path.name}: {len(images)} images"
        left = sorted(p.name for p in tmp_path.iterdir())
        assert not left, f"{path.name}, run {run}: wrote {left} into the folder it ran in"
    left_in_temp = sorted(n for n in _temp_entries() - temp_before
                          if n.startswith(("nbaccel-02-", "nbaccel-05-", "big-model-")))
    assert not left_in_temp, f"{path.name} left {left_in_temp} in the temporary folder"
