"""The launcher on one XLA replica (torch_xla's CPU runtime): results, output, failures, stopping.

Every launch goes through ``notebook_launcher`` exactly as a notebook on a TPU would call it, with
``distributed_type="XLA"`` (or ``NBACCEL_TPU=1``) sending it through ``torch_xla.launch``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

pytest.importorskip("torch_xla")

import torch

from nbaccel import notebook_launcher
from nbaccel.config import LaunchConfig
from nbaccel.errors import (
    ConfigError,
    LaunchTimeoutError,
    PayloadPicklingError,
    ProcessExitedError,
)
from nbaccel.launch.failures import RemoteTraceback

pytestmark = pytest.mark.xla

XLA = LaunchConfig(distributed_type="XLA")


def launch(function, *args, **kwargs):
    return notebook_launcher(function, args, config=XLA, **kwargs)


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry))
    return found


def where_am_i():
    import torch_xla
    import torch_xla.runtime as xr

    from nbaccel.environment import read_worker_settings

    value = torch.arange(3.0, device=torch_xla.device()) * 2
    return {"ordinal": xr.global_ordinal(), "world": xr.world_size(), "value": value,
            "device": str(value.device), "settings": read_worker_settings().distributed_type}


def test_result_comes_back_on_cpu():
    result = launch(where_am_i)
    assert result["ordinal"] == 0 and result["world"] == 1
    assert result["device"].startswith("xla")
    assert result["value"].device.type == "cpu" and result["value"].tolist() == [0.0, 2.0, 4.0]
    assert result["settings"] == "XLA"


def test_return_all_and_a_large_result():
    big = launch(lambda: torch.ones(300_000), return_all=True)  # 1.2 MB: far above a pipe buffer
    assert list(big) == [0] and big[0].sum().item() == 300_000


def test_tpu_override_routes_a_plain_launch_through_torch_xla(monkeypatch):
    monkeypatch.setenv("NBACCEL_TPU", "1")
    assert notebook_launcher(where_am_i)["device"].startswith("xla")


def test_output_is_labelled_including_native_writes(capsys):
    def chatty():
        print("from python")
        print("to stderr", file=sys.stderr)
        os.write(1, b"from the fd\n")  # what C++ code writes
        return 1
    assert launch(chatty) == 1
    out, err = capsys.readouterr()
    assert "[rank0]: from python\n" in out and "[rank0]: from the fd\n" in out
    assert "[rank0]: to stderr\n" in err


def test_exception_is_reraised_with_its_remote_traceback():
    def fails():
        raise KeyError("missing column")
    with pytest.raises(KeyError) as info:
        launch(fails)
    assert info.value.launch_failures[0].rank == 0
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "in fails" in info.value.__cause__.text


def test_exit_without_exception_is_reported():
    with pytest.raises(ProcessExitedError) as info:
        launch(lambda: os._exit(7))
    root = info.value.root_cause
    assert root.rank == 0 and root.exitcode == 7 and "without reporting" in root.message


def test_sys_exit_zero_is_a_normal_return():
    assert launch(lambda: sys.exit(0)) is None


def test_unpicklable_result_is_named():
    with pytest.raises(PayloadPicklingError) as info:
        launch(lambda: threading.Lock())
    assert info.value.object_path == "return value"


def test_host_failure_before_any_replica_is_the_root_cause(monkeypatch):
    monkeypatch.setenv("XLA_USE_SPMD", "1")  # torch_xla.launch refuses SPMD before starting anything
    with pytest.raises(NotImplementedError) as info:
        launch(where_am_i)
    root = info.value.launch_failures[0]
    assert root.rank == -1 and "before any replica started" in root.message


def test_bad_output_ranks_start_nothing():
    with pytest.raises(ConfigError) as info:
        launch(where_am_i, output_ranks=[3])
    assert info.value.key == "output_ranks"


def test_timeout_stops_the_replica_and_dumps_its_stack():
    def sleeps():
        time.sleep(60)
    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        launch(sleeps, timeout=1.5)
    assert time.monotonic() - started < 20
    assert info.value.reason == "timeout" and "in sleeps" in info.value.stacks[0]


def test_interrupt_stops_everything_and_the_next_launch_works():
    pids = []

    def sleeps():
        time.sleep(60)
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    observer = type("Observer", (), {
        "on_launch": lambda self, ranks, method: None, "on_output": lambda self, *a: None,
        "on_end": lambda self, ok: pids.append(ok),
        "on_state": lambda self, rank, state: pids.append((rank, state))})()
    with pytest.raises(KeyboardInterrupt):
        launch(sleeps, observer=observer)
    timer.cancel()
    assert (0, "running") in pids and pids[-1] is False
    from tests.launch.procs import (
        children as live_children,  # leaves out the launcher's group reaper
    )

    assert not [c for c in live_children() if group_members(c)], "a host process group outlived the launch"
    assert launch(lambda: 42) == 42


def test_no_descriptor_leaks_across_launches():
    launch(lambda: 0)
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        launch(lambda: 0)
    assert set(os.listdir("/proc/self/fd")) == before
