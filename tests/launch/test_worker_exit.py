"""How a worker leaves its process group: by exiting when every group is gloo's on the CPU, else by destroying it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbaccel import notebook_launcher


def _join_and_note_destroys(marks: str, cuda_touched: bool) -> int:
    import torch
    import torch.distributed as dist

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    destroy = dist.destroy_process_group

    def noted(*args, **kwargs):
        Path(marks, f"destroyed-{accelerator.process_index}").touch()
        return destroy(*args, **kwargs)

    dist.destroy_process_group = noted
    if cuda_touched:  # as if the function had used a GPU: collectives may still run on it
        torch.cuda.is_initialized = lambda: True
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total.item())


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_gloo_group_on_the_cpu_is_left_by_exiting(tmp_path, start_method):
    """Destroying it would cost each worker 20-50 ms (gloo's loop ticks); the exit closes its sockets."""
    assert notebook_launcher(_join_and_note_destroys, (str(tmp_path), False), num_processes=2,
                             start_method=start_method) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert notebook_launcher(_join_and_note_destroys, (str(tmp_path), False), num_processes=2) == 2  # the next works


def test_a_worker_that_touched_cuda_destroys_its_group_before_leaving(tmp_path):
    assert notebook_launcher(_join_and_note_destroys, (str(tmp_path), True), num_processes=2) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["destroyed-0", "destroyed-1"]
