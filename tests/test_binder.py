"""binder/ builds what pyproject.toml declares: same runtime packages, CPU torch, nbaccel itself."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_binder_requirements_match_pyproject_dependencies():
    declared = {_name(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    lines = [line.strip() for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()]
    listed = {_name(line) for line in lines if line and not line.startswith(("#", "-"))}
    assert declared <= listed, f"binder lacks {sorted(declared - listed)}"
    # Besides JupyterLab, what the notebooks use from nbaccel's extras: the live chart and TensorBoard (02).
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    optional = {"jupyterlab"} | {_name(d) for extra in ("live", "tensorboard") for d in extras[extra]}
    assert listed - declared <= optional, f"binder has extra {sorted(listed - declared - optional)}"
    assert optional - {"jupyterlab"} <= listed, "binder lacks what notebook 02 uses: matplotlib, tensorboard"


def test_binder_uses_cpu_torch_and_installs_nbaccel():
    text = (ROOT / "binder" / "requirements.txt").read_text()
    assert "torch==2.13.0" in text and "/whl/cpu" in text
    assert "pip install --no-deps -e ." in (ROOT / "binder" / "postBuild").read_text()
