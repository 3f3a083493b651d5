"""The in-process IPython shell of the magics' tests, for the %accel_runs tests."""

from __future__ import annotations

from tests.magics.conftest import ip  # noqa: F401 - a fixture, used by name
