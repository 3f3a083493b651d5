"""A warm rank's fresh run covers the process, not just Python's objects.

Rows of issue 33: what one-process launch on the kept rank left behind reached the next one:
processes and threads it started (a leftover thread's lines appeared as the next launch's output),
signal handlers (a SIGTERM handler made closing the rank take 5 s), umask, resource limits, torch's
thread counts, anomaly mode and print options, the recursion limit (123 broke nbaccel's own
restore), atexit callbacks, warnings filters, logging; a module imported only inside the rank was
never checked for edits; and ``gc.freeze()`` after each run kept models in reference cycles alive.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types
import weakref

import pytest
import torch

from nbaccel import notebook_launcher
from nbaccel.launch.pool import warm
from tests.launch.procs import alive


def _launch(function, *args):
    return notebook_launcher(function, args, num_processes=1, use_cpu=True, timeout=120)


def _start_descendant(kind: str) -> int:
    import subprocess

    if kind == "popen":
        return subprocess.Popen(["sleep", "300"]).pid
    if kind == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(300)
            os._exit(0)
        return child
    if kind == "setsid daemon":
        return subprocess.Popen(["sleep", "300"], start_new_session=True).pid
    # a double fork: the shell exits at once, its child is orphaned (to the rank, a subreaper)
    return int(subprocess.run(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.parametrize("kind", ["popen", "fork", "setsid daemon", "double fork"])
def test_every_process_a_run_started_is_gone_when_the_launch_returns(kind):
    started = _launch(_start_descendant, kind)
    assert not alive(started)  # at once: ended before the launch returned, not some time later


def _start_talking_thread(marker: str, daemon: bool) -> int:
    import threading

    def talk() -> None:
        for n in range(500):
            print(f"leftover line {n}", flush=True)
            with open(marker, "a") as out:
                out.write("x")
            time.sleep(0.01)

    threading.Thread(target=talk, daemon=daemon).start()
    time.sleep(0.05)
    return os.getpid()


def _say(word: str) -> str:
    print(word, flush=True)
    return word


@pytest.mark.parametrize("daemon", [True, False])
def test_a_thread_a_run_started_is_ended_and_its_lines_never_reach_the_next_launch(tmp_path, capsys, daemon):
    marker = tmp_path / "thread-wrote"
    _launch(_start_talking_thread, str(marker), daemon)
    written = marker.stat().st_size
    time.sleep(0.5)
    assert marker.stat().st_size == written  # the thread wrote nothing after the launch returned
    capsys.readouterr()
    assert _launch(_say, "second") == "second"
    out = capsys.readouterr().out
    assert "second" in out and "leftover" not in out


def _ignore_sigterm() -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    return os.getpid()


def test_a_sigterm_handler_left_by_a_run_does_not_slow_closing_the_rank():
    pid = _launch(_ignore_sigterm)
    began = time.monotonic()
    assert warm.close_warm_rank()
    assert time.monotonic() - began < 4.0  # it waited the 5 s grace for a rank that ignored SIGTERM
    assert not alive(pid)


def _keep() -> types.SimpleNamespace:
    """A module global of the rank's that outlives runs (on a module already imported: the run imports nothing)."""
    if not hasattr(signal, "nbaccel_test_keep"):
        signal.nbaccel_test_keep = types.SimpleNamespace()  # type: ignore[attr-defined]  # the test's own global
    return signal.nbaccel_test_keep  # type: ignore[attr-defined]  # set just above


def _change(setting: str) -> None:
    import atexit
    import logging
    import resource
    import warnings

    if setting == "signal handler":
        signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    elif setting == "signal mask":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    elif setting == "interval timer":
        signal.setitimer(signal.ITIMER_REAL, 300.0)
    elif setting == "umask":
        os.umask(0o077)
    elif setting == "resource limit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    elif setting == "torch threads":
        torch.set_num_threads(torch.get_num_threads() + 1)
    elif setting == "anomaly mode":
        torch.autograd.set_detect_anomaly(True)
    elif setting == "print options":
        torch.set_printoptions(precision=9, linewidth=40)
    elif setting == "recursion limit":
        sys.setrecursionlimit(123)
    elif setting == "atexit":
        class Held:
            def close(self) -> None:
                print("closed at exit")

        held = Held()
        _keep().held = weakref.ref(held)
        atexit.register(held.close)  # holds it (and whatever it holds) until the process exits
    elif setting == "warnings filters":
        warnings.simplefilter("error")
    elif setting == "logging":
        logging.basicConfig(level=logging.DEBUG, force=True)
        logging.getLogger("nbaccel").setLevel(logging.ERROR)


def _read(setting: str) -> object:
    import logging
    import resource
    import warnings

    return {
        "signal handler": lambda: repr(signal.getsignal(signal.SIGUSR2)),
        "signal mask": lambda: sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "interval timer": lambda: signal.getitimer(signal.ITIMER_REAL)[0] > 0,
        "umask": lambda: (lambda old: (os.umask(old), old)[1])(os.umask(0o022)),  # reading it means setting it
        "resource limit": lambda: resource.getrlimit(resource.RLIMIT_NOFILE),
        "torch threads": torch.get_num_threads,
        "anomaly mode": torch.is_anomaly_enabled,
        "print options": lambda: str(torch.tensor([1 / 3] * 8)),
        "recursion limit": sys.getrecursionlimit,
        "atexit": lambda: getattr(_keep(), "held", lambda: None)() is not None,
        "warnings filters": lambda: [str(f) for f in warnings.filters],
        "logging": lambda: (logging.getLogger().level, len(logging.getLogger().handlers),
                            logging.getLogger("nbaccel").level),
    }[setting]()


def _change_then_read(setting: str) -> tuple[int, object]:
    _change(setting)
    return os.getpid(), _read(setting)


def _read_here(setting: str) -> tuple[int, object]:
    return os.getpid(), _read(setting)


SETTINGS = ["signal handler", "signal mask", "interval timer", "umask", "resource limit", "torch threads",
            "anomaly mode", "print options", "recursion limit", "atexit", "warnings filters", "logging"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_process_setting_a_run_changed_is_put_back_for_the_next_launch(setting):
    rank, before = _launch(_read_here, setting)
    same_rank, changed = _launch(_change_then_read, setting)
    assert same_rank == rank and changed != before  # the run did change it, on the kept rank
    later_rank, after = _launch(_read_here, setting)
    assert after == before
    assert later_rank == rank  # put back in place: the rank was kept


def _leave_what_cannot_be_put_back(what: str) -> int:
    import ctypes
    import resource

    if what == "inter-op threads":
        torch.set_num_interop_threads(torch.get_num_interop_threads() + 1)  # torch allows this once per process
    elif what == "user":
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)  # nobody: the rank cannot become root again
    else:  # a lowered hard limit, without the capability to raise it again
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowered = min(hard, 512)  # a hard limit already under 512 stays (raising it needs the capability)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, lowered), lowered))
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.capget(header, data) == 0
        data[0] &= ~(1 << 24)  # CAP_SYS_RESOURCE out of the effective set
        assert libc.capset(header, data) == 0
    return os.getpid()


def _interop_threads() -> tuple[int, int]:
    return os.getpid(), torch.get_num_interop_threads()


@pytest.mark.parametrize("what", ["inter-op threads", "user", "hard resource limit"])
def test_a_setting_that_cannot_be_put_back_gets_the_next_launch_a_new_rank(what):
    if what != "inter-op threads" and os.geteuid() != 0:
        pytest.skip("only root can give up its user or a capability here")
    rank, interop = _launch(_interop_threads)
    assert _launch(_leave_what_cannot_be_put_back, what) == rank
    assert not alive(rank)  # replaced before the launch returned
    later_rank, later_interop = _launch(_interop_threads)
    assert later_rank != rank and later_interop == interop


def _import_rank_only_module(name: str) -> str:
    import importlib

    return importlib.import_module(name).VALUE


def test_a_module_imported_only_in_the_rank_is_checked_for_edits(tmp_path, monkeypatch):
    source = tmp_path / "rank_only_helpers.py"
    source.write_text("VALUE = 'first'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _launch(_import_rank_only_module, "rank_only_helpers") == "first"
    assert "rank_only_helpers" not in sys.modules  # the caller never imported it
    source.write_text("VALUE = 'edited'\n")
    edited = time.time() + 2  # later than the run that imported it, whatever the file system's clock resolution
    os.utime(source, (edited, edited))
    assert _launch(_import_rank_only_module, "rank_only_helpers") == "edited"


def _keep_a_model_in_a_cycle(returned: bool) -> object:
    keep = _keep()
    model = torch.nn.Linear(4, 4)
    model.register_forward_hook(lambda module, inputs, output: model)  # a hook closing over it: a cycle
    keep.ref = weakref.ref(model)
    if returned:
        return model  # alive while the rank cleans up, dropped once it is sent
    keep.model = model
    return None


def _drop_the_kept_model() -> None:
    _keep().__dict__.pop("model", None)


def _kept_model_collected() -> bool:
    return _keep().ref() is None


@pytest.mark.parametrize("returned", [True, False])
def test_a_model_in_a_reference_cycle_dropped_by_a_later_run_is_collected(returned):
    _launch(_keep_a_model_in_a_cycle, returned)
    _launch(_drop_the_kept_model)
    _launch(_drop_the_kept_model)  # its collection ends with the second run after the drop at the latest
    assert _launch(_kept_model_collected) is True


def _show_a_progress_bar() -> int:
    from tqdm import tqdm

    for _ in tqdm(range(3)):
        pass
    return os.getpid()


def test_a_progress_bars_monitor_thread_is_ended_without_replacing_the_rank():
    """tqdm keeps a monitor thread for the process's life: it is ended the library's way, and the rank kept."""
    first = _launch(_show_a_progress_bar)
    assert _launch(_show_a_progress_bar) == first
