"""notebooks/07_ray_cluster.ipynb runs top to bottom in a real kernel (inside the loopback namespace)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.test_notebooks import _text

NOTEBOOK = Path(__file__).parent.parent.parent / "notebooks" / "07_ray_cluster.ipynb"
EXPECTED = ["2 Ray nodes, 4 CPUs", "[rank3]: rank 3 of 4", "local rank 1", "loss after 200 steps",
            "learned: [1.0, 2.0, 3.0", "caught: bad batch on rank 3 | root cause rank: 3",
            "actors alive: 0 | placement groups kept: 0", "4 warm workers started (ray)",
            "sum over the ranks, from the state the last cell left: [6.0, 6.0]", "warm workers stopped"]


def test_the_ray_notebook_runs_in_a_real_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = _text(nb)
    missing = [text for text in EXPECTED if text not in shown]
    assert not missing, f"outputs lack {missing}:\n{shown}"
