"""A warm pool runs task after task in the same workers, keeping their process group and their state."""

from __future__ import annotations

import os

import pytest

from nbaccel import (
    ConfigError,
    LaunchConfig,
    PayloadPicklingError,
    WorkerPool,
    WorkerPoolError,
)
from nbaccel.launch.base import Launcher
from nbaccel.launch.request import build_request

from .helpers import LoadsNowhere, pid_and_rank, recall, remember


def test_runs_return_rank_0s_value_or_every_rank_in_the_same_workers(pool):
    first = pool.run(pid_and_rank, return_all=True)
    assert sorted(first) == [0, 1] and [rank for _, rank in first.values()] == [0, 1]
    assert pool.run(pid_and_rank) == first[0]
    again = pool.run(pid_and_rank, return_all=True)
    assert again == first and [pid for pid, _ in first.values()] == pool.pids
    assert pool.num_processes == 2 and pool.alive and os.getpid() not in pool.pids


def test_arguments_and_keywords_reach_the_function(pool):
    assert pool.run(lambda a, b=0: a * 10 + b, 4, b=2) == 42


def test_names_kept_in_one_run_are_there_in_the_next(pool):
    pool.run(remember, "answer", 41)
    assert pool.run(recall, "answer", return_all=True) == {0: 41, 1: 41}


def test_output_is_relayed_live_and_labelled(pool, capsys):
    pool.run(lambda: print("hello from", os.environ["RANK"]))
    out = capsys.readouterr().out
    assert "[rank0]: hello from 0" in out and "[rank1]: hello from 1" in out


def test_accelerator_joins_the_existing_group_and_a_prepared_model_stays_prepared(pool):
    def prepare():
        import torch
        import torch.distributed as dist

        from nbaccel import Accelerator, worker_namespace
        accelerator = Accelerator()
        torch.manual_seed(int(os.environ["RANK"]))  # different weights per rank: DDP must sync them
        model = accelerator.prepare(torch.nn.Linear(4, 1))
        worker_namespace().update(model=model, group=id(dist.group.WORLD))
        return type(model).__name__, accelerator.num_processes

    def step():
        import torch
        import torch.distributed as dist

        from nbaccel import Accelerator, worker_namespace
        ns = worker_namespace()
        accelerator = Accelerator()
        model = ns["model"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        accelerator.backward(model(torch.full((2, 4), float(os.environ["RANK"]) + 1)).sum())
        optimizer.step()
        weights = model.module.weight.detach().clone()
        gathered = [torch.empty_like(weights) for _ in range(2)]
        dist.all_gather(gathered, weights)
        return id(dist.group.WORLD) == ns["group"], torch.equal(gathered[0], gathered[1]), accelerator.num_processes

    assert pool.run(prepare) == ("DistributedDataParallel", 2)
    assert pool.run(step, return_all=True) == {0: (True, True, 2), 1: (True, True, 2)}


def test_what_cannot_be_sent_is_named_and_the_pool_stays(pool):
    import threading

    lock = threading.Lock()
    with pytest.raises(PayloadPicklingError) as info:
        pool.run(lambda held: held, lock)
    assert info.value.object_path == "args[0]"
    assert pool.alive and pool.run(lambda: 1) == 1


def test_the_pool_is_a_launcher_for_a_request(pool):
    assert isinstance(pool, Launcher)
    request = build_request(lambda x: x + 1, (1,), num_processes=2, use_cpu=True, return_all=True)
    assert pool.launch(request) == {0: 2, 1: 2}


def test_workers_report_rank_pid_device_and_memory(pool):
    infos = pool.workers()
    assert [(w.rank, w.pid, w.alive, w.device) for w in infos] == [(0, pool.pids[0], True, "cpu"),
                                                                    (1, pool.pids[1], True, "cpu")]
    assert all(w.memory_bytes and w.memory_bytes > 10_000_000 for w in infos)


def test_spawned_workers_run_task_after_task():
    with WorkerPool(num_processes=2, use_cpu=True, start_method="spawn") as spawned:
        assert spawned.start_method == "spawn"
        spawned.run(remember, "kept", "yes")
        assert spawned.run(recall, "kept", return_all=True) == {0: "yes", 1: "yes"}
        assert [pid for pid, _ in spawned.run(pid_and_rank, return_all=True).values()] == spawned.pids


@pytest.mark.parametrize("kwargs, key", [
    ({"grace": 0}, "grace"),
    ({"start_timeout": "soon"}, "start_timeout"),
    ({"config": LaunchConfig(num_machines=2, main_process_ip="10.0.0.1", main_process_port=29400)}, "num_machines"),
    ({"num_processes": 0}, "num_processes"),
])
def test_bad_options_are_refused_before_anything_starts(kwargs, key):
    with pytest.raises(ConfigError) as info:
        WorkerPool(use_cpu=True, **kwargs)
    assert info.value.key == key and "Fix:" in str(info.value)


def test_a_closed_pool_refuses_to_run_until_restarted():
    pool = WorkerPool(num_processes=2, use_cpu=True)
    pids = pool.pids
    with pool:
        pass
    pool.close()  # idempotent
    assert not pool.alive and pool.workers() == []
    with pytest.raises(WorkerPoolError) as info:
        pool.run(int)
    assert info.value.state == "closed" and "restart" in str(info.value)
    pool.restart()
    try:
        assert pool.alive and pool.run(lambda: 3) == 3 and set(pool.pids).isdisjoint(pids)
    finally:
        pool.close()


def test_xla_devices_are_refused_with_a_way_out(monkeypatch):
    import dataclasses

    from nbaccel.launch import request as request_module

    real = request_module.plan_launch
    monkeypatch.setattr(request_module, "plan_launch", lambda cfg: dataclasses.replace(real(cfg), device_kind="xla"))
    with pytest.raises(ConfigError) as info:  # as a TPU machine would plan it (torch_xla is not installed here)
        WorkerPool(num_processes=2, use_cpu=True)
    assert info.value.value == "XLA" and "notebook_launcher" in str(info.value)


def test_workers_that_do_not_start_in_time_are_stopped_with_a_clear_error():
    from nbaccel import LaunchError

    from ..launch.procs import children

    before = children()
    with pytest.raises(LaunchError) as info:
        WorkerPool(num_processes=2, use_cpu=True, start_timeout=0.001)
    assert "start_timeout=0.001" in str(info.value) and "Fix:" in str(info.value)
    assert set(children()) == set(before)



def _kept_layer_weight() -> list[float]:
    from nbaccel import worker_namespace

    return worker_namespace()["layer"].weight.flatten().tolist()


def test_a_returned_module_comes_back_and_the_worker_keeps_its_own(pool):
    def build():
        import torch

        from nbaccel import worker_namespace
        torch.manual_seed(0)
        worker_namespace()["layer"] = torch.nn.Linear(2, 2)
        return worker_namespace()["layer"]

    layer = pool.run(build)
    assert layer.weight.flatten().tolist() == pool.run(_kept_layer_weight)
    layer.weight.data.zero_()  # the notebook's copy is its own
    assert pool.run(_kept_layer_weight) != [0.0] * 4


def test_a_task_that_cannot_be_rebuilt_in_the_workers_fails_and_the_pool_stays(pool):
    with pytest.raises(ValueError, match="cannot be rebuilt") as info:
        pool.run(print, LoadsNowhere())
    assert sorted(f.rank for f in info.value.failures) == [0, 1]
    assert pool.alive and pool.run(lambda: 2) == 2


def test_a_task_that_does_not_load_reports_why_even_with_a_cancel_pending(monkeypatch):
    """Each rank says why the payload did not load, even when the owner's cancel already reached it.

    The owner cancels the other ranks as soon as the first rank reports; a rank that had not yet
    entered the task used to report that cancel (an interrupt) instead of its own load error.
    """
    import cloudpickle

    from nbaccel.launch.pool import serve

    function, args, kwargs = serve._load_task(cloudpickle.dumps((print, (LoadsNowhere(),), {})))
    monkeypatch.setattr(serve, "_armed", True)
    monkeypatch.setattr(serve, "_pending", True)  # a cancel arrived between "started" and the call
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        function(*args, **kwargs)


def test_a_request_for_ranks_the_pool_lacks_is_refused(pool):
    with pytest.raises(ConfigError) as info:
        pool.request(print, output_ranks=[0, 5])
    assert info.value.key == "output_ranks" and info.value.valid == [0, 1]


def test_workers_that_fail_to_join_the_group_stop_the_start(monkeypatch):
    from ..launch.procs import children

    before = children()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nbaccel-no-such-interface")  # the user's choice wins; gloo refuses
    with pytest.raises(RuntimeError, match="nbaccel-no-such-interface") as info:  # gloo's own error, as raised
        WorkerPool(num_processes=2, use_cpu=True)
    assert info.value.launch_failures[0].exc_type.endswith("Error")
    assert set(children()) == set(before)
