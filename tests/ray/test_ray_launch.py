"""`notebook_launcher(..., backend="ray")` on a two-node Ray cluster (see conftest.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nbaccel import notebook_launcher
from nbaccel.errors import ConfigError, LaunchTimeoutError, WorkerFailedError
from tests.ray.conftest import wait_until_clean

pytestmark = pytest.mark.usefixtures("ray_cluster")


def train_steps(steps: int) -> dict:
    """A few DDP steps through nbaccel's Accelerator; the trained weights and where this rank ran."""
    import torch

    from nbaccel import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(100 + accelerator.process_index)  # each rank its own data
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
    print(f"rank {accelerator.process_index} trained")
    return {"weights": accelerator.unwrap_model(model).weight.detach().clone(), "sum": total.item(),
            "world": accelerator.num_processes, "node_rank": int(os.environ["NODE_RANK"]),
            "local_rank": accelerator.local_process_index, "node_id": _ray_node()}


def _ray_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def test_ranks_span_both_nodes_and_train_as_a_local_launch_does(capfd):
    results = notebook_launcher(train_steps, (3,), num_processes=4, backend="ray", use_cpu=True, return_all=True)
    assert sorted(results) == [0, 1, 2, 3]
    assert {r["world"] for r in results.values()} == {4}
    assert {r["sum"] for r in results.values()} == {10.0}  # 1 + 2 + 3 + 4: every rank in one all-reduce
    assert len({r["node_id"] for r in results.values()}) == 2  # PACK on 2 nodes of 2 CPUs: 2 ranks each
    assert [(r["node_rank"], r["local_rank"]) for _, r in sorted(results.items())] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results.values():  # DDP kept every replica equal
        assert r["weights"].equal(results[0]["weights"])
    out = capfd.readouterr().out
    for rank in range(4):
        assert f"[rank{rank}]: rank {rank} trained" in out
    # The same function launched on this machine trains to the same weights, bit for bit.
    local = notebook_launcher(train_steps, (3,), num_processes=4, use_cpu=True, start_method="spawn")
    assert local["weights"].equal(results[0]["weights"])
    assert wait_until_clean() == ([], [])


def test_rank_zero_value_by_default_and_nothing_left_after_success():
    assert notebook_launcher(lambda: int(os.environ["RANK"]) * 10 + 7, num_processes=2, backend="ray",
                             use_cpu=True) == 7
    assert wait_until_clean() == ([], [])


def failing(rank_to_fail: int) -> None:
    import time

    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == rank_to_fail:
        raise ValueError(f"bad batch on rank {rank_to_fail}")
    dist.barrier()  # the others wait for the failed rank: stopped by the launcher
    time.sleep(60)


def test_a_failing_rank_raises_its_own_exception_with_the_remote_traceback():
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 2") as info:
        notebook_launcher(failing, (2,), num_processes=4, backend="ray", use_cpu=True)
    assert isinstance(info.value, WorkerFailedError)
    assert info.value.failures[0].rank == 2
    assert "in failing" in info.value.failures[0].traceback  # the worker's own traceback
    assert "root cause: rank 2" in "\n".join(getattr(info.value, "__notes__", []))
    # The others wait in a barrier that only the process group's timeout (30 min) would end: they were
    # stopped, not waited for. 240 s is far from both, and leaves room for a loaded machine (57 s seen).
    assert time.monotonic() - started < 240
    assert wait_until_clean() == ([], [])


def test_an_interrupt_stops_the_job_and_leaves_nothing_on_the_cluster():
    main = threading.get_ident()
    started = threading.Event()

    def sleeper() -> None:
        import time
        print("sleeping", flush=True)
        time.sleep(120)

    class Observer:
        def on_launch(self, ranks, start_method): pass
        def on_state(self, rank, state):
            if state == "running":
                started.set()
        def on_output(self, rank, stream, line): pass
        def on_end(self, ok): pass

    interrupted_at: list[float] = []

    def interrupt_when_running() -> None:
        started.wait(240)  # placing actors on a loaded machine took up to a minute
        time.sleep(0.5)
        interrupted_at.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleeper, num_processes=2, backend="ray", use_cpu=True, observer=Observer())
    assert started.is_set()
    assert time.monotonic() - interrupted_at[0] < 60  # the sleeper had 120 s left: it was stopped, not waited for
    assert wait_until_clean() == ([], [])


def test_timeout_stops_the_ranks_and_shows_where_they_were():
    def stuck() -> None:
        import time

        def waiting_forever() -> None:
            time.sleep(300)
        waiting_forever()

    with pytest.raises(LaunchTimeoutError) as info:
        # the timeout bounds the run; the actors' start has its own budget (on a loaded machine it took > 30 s)
        notebook_launcher(stuck, num_processes=2, backend="ray", use_cpu=True, timeout=8)
    assert "waiting_forever" in info.value.stacks[0]
    assert wait_until_clean() == ([], [])


def test_a_cluster_too_small_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"5 ranks need 5 CPUs, but the Ray cluster has 4 in all"):
        notebook_launcher(print, num_processes=5, backend="ray", use_cpu=True)
    with pytest.raises(ConfigError, match="the Ray cluster has no GPUs"):
        notebook_launcher(print, num_processes=1, backend="ray", config=_gpu_config())
    assert wait_until_clean() == ([], [])


def _gpu_config():
    from nbaccel.config import LaunchConfig

    return LaunchConfig(distributed_type="MULTI_GPU")


def test_another_ray_address_than_the_connected_one_is_refused():
    with pytest.raises(ConfigError, match="already connected to the Ray cluster"):
        notebook_launcher(print, num_processes=1, backend="ray", use_cpu=True, ray_address="10.1.2.3:6379")


def test_backend_ray_from_the_config_file(tmp_path):
    from nbaccel.config import LaunchConfig, load_config, save_config
    from nbaccel.launch.request import build_request

    path = save_config(LaunchConfig(backend="ray", num_processes=2, use_cpu=True), tmp_path / "c.yaml")
    assert "backend: ray" in path.read_text()
    request = build_request(print, config=load_config(path))
    assert (request.launcher, request.num_processes, request.plan.device_kind) == ("ray", 2, "cpu")
