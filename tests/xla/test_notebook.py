"""notebooks/04_tpu.ipynb runs top to bottom in a real kernel on torch_xla's CPU runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

import nbformat
from nbclient import NotebookClient

pytestmark = pytest.mark.xla

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "04_tpu.ipynb"


def test_tpu_notebook_runs_on_the_cpu_runtime(monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "replicas: 2" in text
    assert "[rank0]: replica 0 of 2 on xla:0" in text and "[rank1]: replica 1 of 2 on xla:1" in text
    assert "learned: [2.0, -3.0, 0.5]" in text
    assert "after set_seed, XLA runtime initialized here: False" in text  # and the launches after it ran
    assert "answer from rank 0: 42" in text
    assert "raised here: ValueError('a bug in replica code'); root cause: rank 0" in text
