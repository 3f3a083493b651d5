"""Every name nbaccel imports from torch exists in the installed torch, and that torch meets pyproject's floor.

In the main environment this checks the newest torch; ``tests/run_torch_floor.sh`` runs it (with
the FSDP and checkpoint tests) under the oldest torch ``pyproject.toml`` allows, so raising an
import to a newer torch API without raising the floor fails there.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Imported only where an optional package is installed (torch_xla; tensorboard for torch's writer).
OPTIONAL = ("torch_xla", "torch.utils.tensorboard")


def _floor() -> Version:
    match = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml has no torch>=X.Y dependency"
    return Version(match.group(1))


def _torch_imports() -> list[tuple[str, str, str]]:
    """``(file:line, module, name)`` for every ``from torch... import name`` in the package."""
    found = []
    for path in sorted((ROOT / "nbaccel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == "torch":
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found += [(where, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(f"{path.relative_to(ROOT)}:{node.lineno}", alias.name, "")
                          for alias in node.names if alias.name.split(".")[0] == "torch"]
    return found


def test_the_installed_torch_meets_the_floor():
    assert Version(torch.__version__.split("+")[0]) >= _floor()


def test_every_torch_name_nbaccel_imports_exists_in_this_torch():
    imports = _torch_imports()
    assert len(imports) > 50  # the scan sees the package
    missing = []
    for where, module, name in imports:
        if module.startswith(OPTIONAL):
            continue
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{where}: import {module} ({exc})")
            continue
        if name and not hasattr(loaded, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}: from {module} import {name}")
    assert not missing, f"torch {torch.__version__} lacks:\n" + "\n".join(missing)


@pytest.mark.skipif(str(ROOT / ".venv-torch-floor") not in torch.__file__, reason="only under run_torch_floor.sh")
def test_the_floor_run_uses_exactly_the_floor():
    assert Version(torch.__version__.split("+")[0]).release[:2] == _floor().release[:2]
