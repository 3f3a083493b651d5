"""Tracker libraries write into this session's temporary folders, never the user's home."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _tracker_homes(tmp_path_factory: pytest.TempPathFactory) -> None:
    # trackio reads TRACKIO_DIR once, when first imported; wandb and mlflow read theirs when used.
    os.environ.setdefault("TRACKIO_DIR", str(tmp_path_factory.mktemp("trackio")))
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CACHE_DIR", str(tmp_path_factory.mktemp("wandb_cache")))
    os.environ.setdefault("WANDB_CONFIG_DIR", str(tmp_path_factory.mktemp("wandb_config")))
