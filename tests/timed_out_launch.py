"""A launch stopped at its timeout, in seconds on an idle machine, and still green on a busy one.

A test of what a timeout leaves behind has to wait the timeout out. A long one (20–30 s) keeps a slow
machine from timing out before the ranks got to the state under test, but costs every run that much.
``stop_at_a_timeout`` tries a short timeout first and only when the ranks had not got there yet (a
busy machine) runs the launch again with a long one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nbaccel.errors import LaunchTimeoutError


def stop_at_a_timeout(launch: Callable[[float], object], got_there: Callable[[], bool],
                      timeouts: tuple[float, ...] = (6.0, 40.0)) -> None:
    """Run ``launch(timeout)``, which must time out, until ``got_there()`` holds after it."""
    for timeout in timeouts:
        with pytest.raises(LaunchTimeoutError):
            launch(timeout)
        if got_there():
            return
    raise AssertionError(f"the ranks did not get to the state under test within any of the timeouts {timeouts} s")
