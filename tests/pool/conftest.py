"""A 2-worker CPU pool shared by the tests of a module that do not break it."""

from __future__ import annotations

import pytest

from nbaccel import WorkerPool


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(num_processes=2, use_cpu=True, grace=1.0) as shared:
        yield shared
