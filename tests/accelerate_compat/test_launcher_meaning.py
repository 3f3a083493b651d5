"""``notebook_launcher`` means what Accelerate's does: workers see ``ACCELERATE_MIXED_PRECISION``; ``max_restarts``
restarts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nbaccel
from nbaccel.errors import ConfigError

pytest.importorskip("accelerate")


def precision_seen() -> tuple:
    import accelerate
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return os.environ.get("ACCELERATE_MIXED_PRECISION"), accelerate.Accelerator(cpu=True).mixed_precision


def test_workers_see_the_launchs_mixed_precision_under_accelerates_name():
    results = nbaccel.notebook_launcher(precision_seen, num_processes=2, use_cpu=True, mixed_precision="bf16",
                                        return_all=True, timeout=120)
    assert results == {0: ("bf16", "bf16"), 1: ("bf16", "bf16")}  # Accelerate's Accelerator in the worker agrees


def accelerates_own_job() -> tuple:
    import accelerate
    import torch
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked from a parent that may have made one
    accelerator = accelerate.Accelerator()  # no cpu=True: the launch says CPU, as `accelerate launch --cpu` does
    total = accelerator.reduce(torch.ones(1), reduction="sum")
    return accelerator.distributed_type.value, accelerator.num_processes, accelerator.process_index, total.item()


def test_accelerates_accelerator_in_a_cpu_launch_is_one_multi_cpu_job():
    results = nbaccel.notebook_launcher(accelerates_own_job, num_processes=2, return_all=True, timeout=120)
    assert results == {0: ("MULTI_CPU", 2, 0, 2.0), 1: ("MULTI_CPU", 2, 1, 2.0)}


def fails_the_first_time(marker: str) -> int:
    state = nbaccel.PartialState()
    path = Path(marker)
    state.wait_for_everyone()
    if state.process_index == 1 and not path.exists():
        path.write_text("failed once")
        raise RuntimeError("first attempt fails")
    return int(path.exists())


def test_max_restarts_runs_a_failed_launch_again(tmp_path, capfd):
    marker = tmp_path / "attempt"
    assert nbaccel.notebook_launcher(fails_the_first_time, (str(marker),), num_processes=2, use_cpu=True,
                                     max_restarts=1, timeout=120) == 1
    assert "restarting it (1 of 1 restarts)" in capfd.readouterr().err
    marker.unlink()
    with pytest.raises(RuntimeError, match="first attempt fails") as failed:  # max_restarts=0: no second run
        nbaccel.notebook_launcher(fails_the_first_time, (str(marker),), num_processes=2, use_cpu=True, timeout=120)
    assert failed.value.launch_failures[0].rank == 1 and "restarting" not in capfd.readouterr().err
    with pytest.raises(ConfigError) as info:
        nbaccel.notebook_launcher(fails_the_first_time, (str(marker),), num_processes=2, use_cpu=True,
                                  max_restarts=-1)
    assert info.value.key == "max_restarts"
