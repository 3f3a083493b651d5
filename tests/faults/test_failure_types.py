"""What a rank's failure turns into in the caller, for every kind of exception a rank raises (2 CPU ranks over gloo).

Every ``Exception`` type (``RuntimeError`` and ``Exception`` too, the types torch code raises most)
is caught as itself, as ``WorkerFailedError`` and as torch elastic's ``ChildFailedError``; odd
exceptions keep their type where it can be rebuilt and say why where not; a rank's own
``SystemExit`` or ``KeyboardInterrupt`` is a failure of that rank; a huge message is reported once;
an error every rank raised is reported as everyone's; ``close()`` during a run is named.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from nbaccel import WorkerPool, notebook_launcher
from nbaccel.errors import LaunchError, WorkerFailedError, WorkerPoolError
from tests.launch.procs import children
from tests.pool.helpers import wait_for


class RankError(RuntimeError):
    """A user's own RuntimeError subclass."""


class ReduceRaises(ValueError):
    """An exception that refuses to be pickled."""

    def __reduce__(self) -> tuple:
        raise TypeError("this exception does not pickle")


class TwoArguments(ValueError):
    """An exception whose ``args`` cannot rebuild it: ``TwoArguments(*exc.args)`` raises."""

    def __init__(self, path: str, line: int) -> None:
        super().__init__(f"{path}:{line}")
        self.path = path
        self.line = line


class BuiltFromTwo(ValueError):
    """Neither pickles nor can be rebuilt from its parts: ``__new__`` itself needs two arguments."""

    def __new__(cls, path: str, line: int) -> BuiltFromTwo:
        return super().__new__(cls, path, line)

    def __init__(self, path: str, line: int) -> None:
        super().__init__(f"{path}:{line}")

    def __reduce__(self) -> tuple:
        raise TypeError("this exception does not pickle")


def _rank() -> int:
    return int(os.environ["RANK"])


def _rank_1_raises(kind: str) -> None:
    if _rank() != 1:
        return
    made = {"RuntimeError": lambda: RuntimeError("out of memory"), "Exception": lambda: Exception("plain"),
            "ValueError": lambda: ValueError("bad batch"), "KeyError": lambda: KeyError("labels"),
            "RankError": lambda: RankError("collective mismatch"), "LaunchError": lambda: LaunchError("inner launch"),
            "ReduceRaises": lambda: ReduceRaises("odd"), "TwoArguments": lambda: TwoArguments("data.csv", 7),
            "BuiltFromTwo": lambda: BuiltFromTwo("data.csv", 7), "SystemExit": lambda: SystemExit(3),
            "KeyboardInterrupt": lambda: KeyboardInterrupt("rank's own")}
    raise made[kind]()


EVERY_TYPE = [(RuntimeError, "out of memory"), (Exception, "plain"), (ValueError, "bad batch"),
              (KeyError, "'labels'"), (RankError, "collective mismatch"), (LaunchError, "inner launch")]


@pytest.mark.parametrize(("kind", "message"), EVERY_TYPE, ids=[k.__name__ for k, _ in EVERY_TYPE])
def test_every_exception_type_is_caught_as_itself_as_worker_failed_error_and_as_child_failed_error(kind, message):
    with pytest.raises(kind) as info:
        notebook_launcher(_rank_1_raises, args=(kind.__name__,), num_processes=2)
    exc = info.value
    assert type(exc).__name__ == kind.__name__ and str(exc) == message
    assert isinstance(exc, WorkerFailedError) and isinstance(exc, ChildFailedError)
    assert exc.failures[0].rank == 1 and exc.get_first_failure()[0] == 1
    again = pickle.loads(pickle.dumps(exc))  # it travels on as what it is
    assert isinstance(again, kind) and isinstance(again, WorkerFailedError) and isinstance(again, ChildFailedError)
    assert children() == []


def test_an_exception_that_does_not_pickle_or_unpickle_keeps_its_type_and_fields():
    with pytest.raises(ReduceRaises, match="odd") as info:
        notebook_launcher(_rank_1_raises, args=("ReduceRaises",), num_processes=2)
    assert isinstance(info.value, WorkerFailedError) and "ReduceRaises" in info.value.__cause__.text
    with pytest.raises(TwoArguments) as info:
        notebook_launcher(_rank_1_raises, args=("TwoArguments",), num_processes=2)
    assert (str(info.value), info.value.path, info.value.line) == ("data.csv:7", "data.csv", 7)
    assert isinstance(info.value, WorkerFailedError)


def test_an_exception_that_cannot_be_rebuilt_says_why():
    with pytest.raises(WorkerFailedError) as info:
        notebook_launcher(_rank_1_raises, args=("BuiltFromTwo",), num_processes=2)
    root = info.value.root_cause
    assert root.exc_type.endswith("BuiltFromTwo") and "__reduce__" not in root.exception_note
    assert "does not pickle" in root.exception_note and "missing 1 required positional argument" in root.exception_note
    assert "rank 1's tests.faults.test_failure_types.BuiltFromTwo could not be rebuilt here" in str(info.value)
    assert "data.csv:7" in str(info.value)  # its message and traceback are still there


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
def test_a_ranks_own_sys_exit_or_interrupt_is_a_failure_of_that_rank(kind):
    try:
        notebook_launcher(_rank_1_raises, args=(kind,), num_processes=2)
    except BaseException as exc:  # noqa: BLE001 - a SystemExit here would end the caller
        caught = exc
    else:
        caught = None
    assert isinstance(caught, WorkerFailedError) and isinstance(caught, ChildFailedError), repr(caught)
    root = caught.root_cause
    assert (root.rank, root.exc_type) == (1, kind)
    if kind == "SystemExit":
        assert root.exitcode == 3 and "called sys.exit(3) in rank 1" in str(caught)
    else:
        assert "the caller was not interrupted" in str(caught)


def _huge_message() -> None:
    if _rank() == 1:
        raise ValueError("x" * 10_000_000)


def test_a_10_mb_message_is_reported_once_and_cut_in_the_report():
    with pytest.raises(ValueError) as info:
        notebook_launcher(_huge_message, num_processes=2)
    assert len(info.value.args[0]) == 10_000_000  # the exception itself keeps all of it
    shown = "".join(traceback.format_exception(info.value))
    assert 10_000_000 < len(shown) < 10_200_000  # one copy (21 M characters before: two)
    assert "of 10,000,000 characters left out" in shown


def _every_rank_raises_the_same() -> None:
    import signal

    import torch.distributed as dist

    # No rank may be stopped before it raises: stopping is what nbaccel does after the first failure.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    dist.init_process_group("gloo")
    dist.barrier()
    raise ValueError("the dataset is empty")


def test_an_error_every_rank_raised_is_reported_as_everyones():
    with pytest.raises(ValueError) as info:
        notebook_launcher(_every_rank_raises_the_same, num_processes=2)
    note = "\n".join(info.value.__notes__)
    assert "root cause: all 2 ranks raised ValueError: the dataset is empty" in note
    assert "root cause: rank" not in note and "also failed" not in note
    assert sorted(f.rank for f in info.value.failures) == [0, 1]


def _announce_then_sleep(marker: str) -> None:
    import time

    Path(marker, f"rank{os.environ['RANK']}").touch()
    time.sleep(60)


def test_close_racing_a_run_names_close_not_a_signal(tmp_path):
    pool = WorkerPool(num_processes=2, use_cpu=True)

    def close_once_running() -> None:
        wait_for(lambda: len(list(tmp_path.iterdir())) == 2, timeout=60)
        pool.close()

    closer = threading.Thread(target=close_once_running)
    closer.start()
    try:
        with pytest.raises(WorkerPoolError) as info:
            pool.run(_announce_then_sleep, str(tmp_path))
    finally:
        closer.join()
        pool.close()
    assert (info.value.state, info.value.reason) == ("closed", "close()")
    assert "ended by WorkerPool.close()" in str(info.value) and "SIGTERM" not in str(info.value)
    assert not pool.alive and children() == []
