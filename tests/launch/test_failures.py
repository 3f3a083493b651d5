"""A failing rank: the root cause is raised in the caller and the other ranks are stopped."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from nbaccel import (
    PayloadPicklingError,
    ProcessExitedError,
    WorkerFailedError,
    notebook_launcher,
)
from nbaccel.launch.failures import RemoteTraceback

from .procs import children


def _rank() -> int:
    return int(os.environ["RANK"])


class CustomError(Exception):
    pass


def _rank1_raises():
    if _rank() == 1:
        raise CustomError("rank one broke")
    time.sleep(60)


def test_exception_is_reraised_with_type_message_traceback_and_others_stopped():
    with pytest.raises(CustomError, match="rank one broke") as info:
        notebook_launcher(_rank1_raises, num_processes=3)
    failures = info.value.launch_failures
    assert time.time() - failures[0].time < 5  # the sleeping ranks were stopped, not awaited
    assert failures[0].rank == 1 and failures[0].exc_type.endswith("CustomError")
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "_rank1_raises" in cause.text and 'raise CustomError("rank one broke")' in cause.text
    assert any("stopped by nbaccel" in note and "0, 2" in note for note in info.value.__notes__)
    assert children() == []


def _all_raise_same():
    time.sleep(0.2 * _rank())
    raise ValueError("same everywhere")


def test_root_cause_first_and_identical_errors_grouped():
    with pytest.raises(ValueError) as info:
        notebook_launcher(_all_raise_same, num_processes=3)
    failures = info.value.launch_failures
    assert failures[0].rank == 0
    note = "\n".join(info.value.__notes__)
    # On a busy machine rank 1 (or 2) may raise before nbaccel stops it: then it is grouped with rank 0.
    assert re.search(r"root cause: (rank 0 |ranks 0, |all 3 ranks )", note), note
    grouped = {f.rank for f in failures if f.message == "same everywhere"}
    stopped = re.search(r"stopped by nbaccel after the failure: ranks? ([\d, ]+)", note)
    assert not stopped or not grouped & {int(r) for r in stopped.group(1).split(", ")}, note


def _raise_the_same_when_stopped(folder: str) -> None:
    armed = Path(folder, "armed")
    if _rank() == 0:
        while not armed.exists():  # rank 1 can answer the stop before rank 0 fails
            time.sleep(0.01)
        raise ValueError("same everywhere")
    if _rank() == 1:
        def _answer_the_stop(signum: int, frame: object) -> None:
            raise ValueError("same everywhere")

        signal.signal(signal.SIGTERM, _answer_the_stop)
        armed.touch()
    time.sleep(60)


def test_a_rank_that_fails_on_its_own_as_it_is_stopped_is_reported_failed_not_also_stopped(tmp_path):
    """Rank 1's error comes after nbaccel stopped it (on a busy machine it may simply arrive late): it is a failure."""
    with pytest.raises(ValueError) as info:
        notebook_launcher(_raise_the_same_when_stopped, (str(tmp_path),), num_processes=3)
    assert [f.rank for f in info.value.launch_failures] == [0, 1]
    note = "\n".join(info.value.__notes__)
    assert "root cause: rank 0 (pid" in note  # rank 1's traceback differs (its signal handler): not grouped
    assert "also failed: rank 1: raised ValueError: same everywhere" in note
    assert "stopped by nbaccel after the failure: rank 2\n" in note


def _exit_three():
    if _rank() == 1:
        os._exit(3)
    time.sleep(60)


def test_os_exit_is_an_error_not_a_hang():
    with pytest.raises(ProcessExitedError) as info:
        notebook_launcher(_exit_three, num_processes=2)
    root = info.value.root_cause
    assert time.time() - root.time < 5
    assert (root.rank, root.exitcode, root.signal) == (1, 3, None)


def _killed():
    if _rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_sigkill_of_one_rank_is_an_error():
    with pytest.raises(ProcessExitedError) as info:
        notebook_launcher(_killed, num_processes=2)
    assert info.value.root_cause.signal == signal.SIGKILL
    assert "killed by signal SIGKILL" in str(info.value)


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def _raise_unpicklable():
    raise Unpicklable()


def test_exception_that_cannot_be_pickled_keeps_its_type_without_what_cannot_travel():
    with pytest.raises(Unpicklable) as info:
        notebook_launcher(_raise_unpicklable, num_processes=1)
    assert isinstance(info.value, WorkerFailedError)
    assert info.value.root_cause.exc_type.endswith("Unpicklable")
    assert str(info.value) == "cannot travel" and not hasattr(info.value, "lock")  # the lock stayed behind
    assert "_raise_unpicklable" in info.value.__cause__.text


def _return_lock():
    return threading.Lock()


def test_result_that_cannot_be_pickled_is_a_clear_error():
    with pytest.raises(PayloadPicklingError) as info:
        notebook_launcher(_return_lock, num_processes=1)
    assert info.value.object_path == "return value"
    assert "cannot be pickled" in str(info.value)


def _exit_zero_early():
    os._exit(0)


def test_exit_zero_without_returning_is_a_failure():
    with pytest.raises(ProcessExitedError) as info:
        notebook_launcher(_exit_zero_early, num_processes=1)
    assert info.value.root_cause.exitcode == 0


def _sys_exit_zero():
    raise SystemExit(0)


def test_sys_exit_zero_counts_as_returning_none():
    assert notebook_launcher(_sys_exit_zero, num_processes=2) is None


def test_next_launch_after_a_failure_works():
    with pytest.raises(CustomError):
        notebook_launcher(_rank1_raises, num_processes=2)
    assert notebook_launcher(_rank, num_processes=2, return_all=True) == {0: 0, 1: 1}


def _ranks_raise_different_errors():
    time.sleep(0.3 * _rank())
    if _rank() == 0:
        raise FileNotFoundError(2, "No such file or directory", "/data/train.csv")
    raise KeyError(f"rank {_rank()}")


def test_one_family_catches_every_worker_failure_and_the_users_type_still_works():
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_ranks_raise_different_errors, num_processes=3)
    exc = info.value
    assert isinstance(exc, FileNotFoundError) and isinstance(exc, OSError)  # the user's own type
    assert type(exc).__name__ == "FileNotFoundError" and exc.filename == "/data/train.csv" and exc.errno == 2
    assert exc.root_cause is exc.failures[0] and exc.root_cause.rank == 0  # the root cause first
    assert exc.failures == exc.launch_failures
    assert exc.failures[0].rank == 0 and {f.rank for f in exc.failures} <= {0, 1, 2}


def _interrupted_worker():
    raise KeyboardInterrupt("stop")


def test_a_workers_own_interrupt_is_a_failure_of_that_rank_not_the_callers_interrupt():
    with pytest.raises(WorkerFailedError) as info:  # a KeyboardInterrupt here would read as the caller's own Ctrl-C
        notebook_launcher(_interrupted_worker, num_processes=1)
    assert not isinstance(info.value, KeyboardInterrupt)
    assert info.value.failures[0].exc_type == "KeyboardInterrupt"
    assert "raised KeyboardInterrupt itself (the caller was not interrupted)" in str(info.value)


class NoNotesError(Exception):
    """An exception as Python 3.10 has them: no ``add_note`` (3.11+)."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_worker_describes_a_bad_fork_error_on_python_3_10_too():
    from nbaccel.launch.worker.process import _BAD_FORK, describe_error

    report = describe_error(NoNotesError(f"{_BAD_FORK}. To use CUDA with multiprocessing, ..."))
    assert report["exc_type"].endswith("NoNotesError") and _BAD_FORK in report["message"]
