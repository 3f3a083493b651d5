"""The launcher across N replicas of torch_xla's CPU runtime (``CPU_NUM_DEVICES=N``).

There the N replicas are threads of one process, as on a TPU v2/v3 chip, so this also covers the
per-thread output labels. Collectives are not used here: on the CPU runtime two replica threads
that compile the same collective at once abort the process after 10 s (see
``tests/xla/thread_collectives.py``, which ``test_layouts.py`` uses to train on this layout).

What stays untested here, because it needs collectives across replicas or real TPU processes
(``scripts/check_tpu.py`` checks each of these on a real TPU runtime):

- gradient reduction across replicas in ``AcceleratedOptimizer.step`` (``xm.reduce_gradients``)
  and in ``clip_grad_norm_`` / ``clip_grad_value_``;
- ``gather`` / ``reduce`` / ``broadcast`` / ``pad_across_processes`` through XLA collectives;
- ``wait_for_everyone`` as ``xm.rendezvous``;
- ``MpDeviceLoader`` giving each replica its own shard of a prepared dataloader;
- one process per chip (TPU v4 and later): fd-level output labels and the torchrun variables set
  in each replica process, and the ``Accelerator`` seeing every replica's rank and world size;
- ``save_state`` / ``save`` writing once (rank 0) while other replicas wait;
- a replica process killed in native code while others live in other processes.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("torch_xla")

import torch

from nbaccel import notebook_launcher
from nbaccel.config import LaunchConfig
from nbaccel.errors import ProcessExitedError

pytestmark = pytest.mark.xla

XLA = LaunchConfig(distributed_type="XLA")


def launch(function, *args, **kwargs):
    return notebook_launcher(function, args, config=XLA, **kwargs)


def identify(scale):
    import torch_xla
    import torch_xla.runtime as xr

    from nbaccel.launch.xla.launcher import current_replica

    rank = xr.global_ordinal()
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    time.sleep(0.2)  # keep all replicas alive at once, each in its own thread
    value = torch.full((2,), float(rank), device=torch_xla.device()) * scale
    info = current_replica()
    return {"rank": rank, "world": xr.world_size(), "value": value, "replica": (info.rank, info.world_size,
                                                                              info.shares_process)}


def test_every_replica_runs_with_its_ordinal_and_returns(devices, capsys):
    n = devices(3)
    results = launch(identify, 10.0, return_all=True)
    assert sorted(results) == list(range(n))
    for rank, result in results.items():
        assert result["rank"] == rank and result["world"] == n
        assert result["replica"] == (rank, n, True)
        assert result["value"].device.type == "cpu" and result["value"].tolist() == [10.0 * rank] * 2
    out, err = capsys.readouterr()
    for rank in range(n):
        assert f"[rank{rank}]: hello from {rank}\n" in out
        assert f"[rank{rank}]: warning from {rank}\n" in err
    assert launch(identify, 1.0)["rank"] == 0  # without return_all: rank 0's value


def test_output_ranks_filter_only_the_output(devices, capsys):
    devices(2)
    results = launch(identify, 1.0, return_all=True, output_ranks=[1])
    assert sorted(results) == [0, 1]
    out, _ = capsys.readouterr()
    assert "[rank1]: hello from 1" in out and "hello from 0" not in out


def test_native_writes_of_shared_processes_are_labelled_xla(devices, capfd):
    devices(2)

    def native():
        os.write(1, b"from the fd\n")  # C++ output cannot be told apart between threads
        return 0
    launch(native)
    out, _ = capfd.readouterr()
    assert "[xla]: from the fd\n" in out


def test_one_failing_replica_is_the_root_cause_and_the_rest_stop(devices):
    devices(3)

    def fails_on_one():
        import torch_xla.runtime as xr

        if xr.global_ordinal() == 1:
            raise ValueError("bad shard on replica 1")
        time.sleep(30)
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad shard") as info:
        launch(fails_on_one)
    assert time.monotonic() - started < 15
    failures = info.value.launch_failures
    assert [f.rank for f in failures] == [1]
    assert "stopped by nbaccel after the failure: ranks 0, 2" in info.value.__notes__[0]
    assert "world size 3" in info.value.__notes__[0]


def test_a_dead_replica_process_names_every_unreported_rank(devices):
    devices(2)

    def dies():
        import torch_xla.runtime as xr

        if xr.global_ordinal() == 1:
            time.sleep(0.3)
            os._exit(3)  # kills the whole replica process, as an XLA abort would
        time.sleep(30)
    with pytest.raises(ProcessExitedError) as info:
        launch(dies)
    failures = info.value.failures
    assert sorted(f.rank for f in failures) == [0, 1]
    assert "BrokenProcessPool" in failures[0].message and "without reporting" in failures[0].message


def test_num_processes_on_the_cpu_runtime_runs_that_many(devices):
    devices(2)
    results = notebook_launcher(identify, (1.0,), num_processes=3, config=XLA, return_all=True)
    assert sorted(results) == [0, 1, 2] and results[2]["world"] == 3
    assert notebook_launcher(identify, (1.0,), num_processes=1, config=XLA, return_all=True)[0]["world"] == 1


def test_the_accelerator_sees_each_thread_replica(devices):
    devices(2)

    def replica_view():
        import torch_xla.runtime as xr
        from torch.utils.data import DataLoader, TensorDataset

        from nbaccel import Accelerator

        accelerator = Accelerator()
        loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
        seen = [v for (batch,) in loader for v in batch.cpu().tolist()]
        return (xr.global_ordinal(), accelerator.process_index, accelerator.num_processes,
                str(accelerator.device), seen)
    results = launch(replica_view, return_all=True)
    assert [r[1:4] for r in results.values()] == [(0, 2, "xla:0"), (1, 2, "xla:1")]
    assert sorted(results[0][4] + results[1][4]) == [float(i) for i in range(8)]


def test_replicas_die_with_a_killed_caller(devices):
    import signal
    import subprocess

    devices(2)
    code = ("import os, time\nfrom nbaccel import notebook_launcher\nfrom nbaccel.config import LaunchConfig\n"
            "def f():\n    print('pid', os.getpid(), os.getppid(), flush=True)\n    time.sleep(60)\n"
            "notebook_launcher(f, config=LaunchConfig(distributed_type='XLA'))\n")
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        line = caller.stdout.readline()  # "[rankN]: pid REPLICA HOST"
        replica, host = (int(v) for v in line.split()[-2:])
        caller.send_signal(signal.SIGKILL)  # a kernel dying hard: no cleanup code runs
        caller.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (_alive(replica) or _alive(host)):
            time.sleep(0.1)
        assert not _alive(host) and not _alive(replica), "the host or a replica outlived its caller"
    finally:
        caller.kill()
        caller.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
