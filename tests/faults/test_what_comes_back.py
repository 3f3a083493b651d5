"""Exceptions and results come back as themselves, or with a clear reason when they cannot."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nbaccel import LaunchError, notebook_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_an_exception_class_defined_in_main_is_caught_by_its_own_except(start_method):
    """A notebook's cell code lives in ``__main__``, as this script's does."""
    script = textwrap.dedent(f"""
        from nbaccel import notebook_launcher

        class MyErr(Exception):
            pass

        class Point:
            def __init__(self, x):
                self.x = x

        def train(fail):
            import os
            if fail and os.environ["RANK"] == "1":
                raise MyErr("rank 1 gave up")
            return Point(3)

        try:
            notebook_launcher(train, args=(True,), num_processes=2, start_method={start_method!r})
        except MyErr as exc:
            print("caught as itself:", exc)
        point = notebook_launcher(train, args=(False,), num_processes=2, start_method={start_method!r})
        print("result is a Point:", isinstance(point, Point), point.x)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert "caught as itself: rank 1 gave up" in result.stdout, result.stderr[-3000:]
    assert "result is a Point: True 3" in result.stdout


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _raise_broken_str() -> None:
    raise BrokenStr("x")


def test_an_exception_whose_str_raises_keeps_its_type_and_traceback():
    with pytest.raises(BrokenStr) as info:
        notebook_launcher(_raise_broken_str, num_processes=2)
    report = info.value.failures[0]
    assert report.exc_type.endswith("BrokenStr")
    assert "<str() of this BrokenStr raised RuntimeError: no text for you>" in report.message
    assert "_raise_broken_str" in report.traceback and "raise BrokenStr" in report.traceback


def _return_an_object_of_a_worker_only_module(folder: str):
    import sys

    with open(os.path.join(folder, "only_in_the_worker.py"), "w") as f:
        f.write("class Thing:\n    pass\n")
    sys.path.insert(0, folder)
    import only_in_the_worker

    return only_in_the_worker.Thing()


def test_a_result_that_cannot_be_unpickled_here_says_why_and_what_to_return(tmp_path):
    with pytest.raises(LaunchError, match=r"rank 0 finished, but its return value cannot be unpickled in this "
                                          r"process \(module 'only_in_the_worker' is not importable here\).*"
                                          r"Fix: return plain data") as info:
        notebook_launcher(_return_an_object_of_a_worker_only_module, args=(str(tmp_path),), num_processes=2)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert "only_in_the_worker" not in sys.modules


def _rank_1_returns_something_unpicklable():
    import threading

    return threading.Lock() if os.environ["RANK"] == "1" else "rank 0's value"


def test_only_the_values_asked_for_are_pickled_and_sent():
    from nbaccel import PayloadPicklingError

    assert notebook_launcher(_rank_1_returns_something_unpicklable, num_processes=2) == "rank 0's value"
    with pytest.raises(PayloadPicklingError, match="rank 1 returned a lock that cannot be pickled back"):
        notebook_launcher(_rank_1_returns_something_unpicklable, num_processes=2, return_all=True)


def test_large_results_cost_the_caller_a_small_multiple_of_what_it_keeps():
    """Four ranks return 100 MB each; only rank 0's comes back, read without piling up copies."""
    script = textwrap.dedent("""
        import resource
        from nbaccel import notebook_launcher

        def big():
            import torch
            return torch.ones(25 * 2**20)  # 100 MB

        notebook_launcher(lambda: 0, num_processes=2)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        value = notebook_launcher(big, num_processes=4)
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(f"grew {grew:.0f} MB for a {value.numel() * 4 / 2**20:.0f} MB result")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=ROOT)
    import re

    found = re.search(r"grew (\d+) MB for a (\d+) MB result", result.stdout)
    assert found, result.stdout + result.stderr[-2000:]
    grew, size = float(found[1]), float(found[2])
    assert size == 100, result.stderr[-2000:]
    assert grew < 4 * size, result.stdout  # 9x before: every rank's value unpickled, each copied three times
