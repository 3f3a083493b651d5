"""Setup for the package's doctests (``--doctest-modules`` collects ``nbaccel/``): a private config file.

The examples in ``nbaccel/`` run in one CPU process: they need no GPU, TPU or torch_xla, and the
ones that would (or that use names from a training loop) are marked ``# doctest: +SKIP``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _doctest_private_config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_config()`` in an example reads a fresh file, never the user's own config."""
    if isinstance(request.node, pytest.DoctestItem):
        folder = tmp_path_factory.mktemp("doctest")
        monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(folder / "nbaccel_config.yaml"))
