"""notebook_launcher: results, labelled output, settings reaching the workers."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from nbaccel import ConfigError, LaunchConfig, debug_launcher, notebook_launcher


def _rank() -> int:
    return int(os.environ["RANK"])


def _identity(x, *, y=0):
    return {"rank": _rank(), "x": x, "y": y, "world": int(os.environ["WORLD_SIZE"])}


def test_returns_rank0_value_and_all_on_request():
    assert notebook_launcher(_identity, (5,), num_processes=2, kwargs={"y": 7}) == \
        {"rank": 0, "x": 5, "y": 7, "world": 2}
    everything = notebook_launcher(_identity, (1,), num_processes=3, return_all=True)
    assert everything == {r: {"rank": r, "x": 1, "y": 0, "world": 3} for r in range(3)}


def _all_reduce():
    import torch.distributed as dist

    from nbaccel import ProcessState

    state = ProcessState()
    value = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(value)
    return state.num_processes, state.distributed_type, state.backend, value.item()


def test_workers_form_one_gloo_job():
    n, dtype, backend, total = notebook_launcher(_all_reduce, num_processes=4)
    assert (n, dtype, backend, total) == (4, "MULTI_CPU", "gloo", 10.0)


def _big_result():
    return {f"t{i}": torch.full((1_250_000,), float(i)) for i in range(10)}  # 50 MB of float32


def test_results_of_50_mb_come_back():
    out = notebook_launcher(_big_result, num_processes=2)
    assert sorted(out) == [f"t{i}" for i in range(10)]
    assert out["t7"].shape == (1_250_000,) and float(out["t7"][123]) == 7.0


def _talk():
    rank = _rank()
    print(f"hello from python {rank}")
    os.write(1, f"raw fd write {rank}\n".encode())
    os.system(f"echo from a child process {rank}")
    print(f"to stderr {rank}", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    return rank


def test_output_is_labelled_whole_lines_including_fd_writes(capfd):
    notebook_launcher(_talk, num_processes=2)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank{rank}]: hello from python {rank}\n" in out
        assert f"[rank{rank}]: raw fd write {rank}\n" in out
        assert f"[rank{rank}]: from a child process {rank}\n" in out
        assert f"[rank{rank}]: no newline at the end\n" in out
        assert f"[rank{rank}]: to stderr {rank}\n" in err
    assert all(line.startswith("[rank") for line in out.splitlines() if line)


def _torch_warns() -> None:
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), find_unused_parameters=True)
    model(torch.ones(1, 2)).sum().backward()  # torch's C++ warns, its line starting "[rankN]:" already
    del model
    gc.collect()
    dist.destroy_process_group()


def test_torchs_own_rank_prefix_is_not_doubled(capfd):
    notebook_launcher(_torch_warns, num_processes=2)
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"[rank{rank}]: [W" in err and "find_unused_parameters=True was specified" in err
    assert "[rank0]: [rank0]:" not in err and "[rank1]: [rank1]:" not in err


def test_output_ranks_filter_shows_only_some_ranks(capfd):
    assert notebook_launcher(_talk, num_processes=3, output_ranks=[1], return_all=True) == {0: 0, 1: 1, 2: 2}
    out, _ = capfd.readouterr()
    assert "[rank1]: hello from python 1" in out
    assert "[rank0]" not in out and "[rank2]" not in out


def test_output_ranks_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        notebook_launcher(_talk, num_processes=2, output_ranks=[5])
    assert info.value.key == "output_ranks" and info.value.valid == [0, 1]


def _progress():
    for i in range(3):
        sys.stdout.write(f"\rstep {i}/3")
        sys.stdout.flush()
        time.sleep(0.05)
    sys.stdout.write("\n")
    print("done")


def test_progress_bars_redraw_in_place(capfd):
    notebook_launcher(_progress, num_processes=1)
    out, _ = capfd.readouterr()
    assert "\r[rank0]: step 2/3\n" in out
    assert "[rank0]: done\n" in out


def _output_is_live():
    print("first", flush=True)
    time.sleep(1.5)
    return time.time()


class _Recorder:
    def __init__(self):
        self.lines, self.states = [], []

    def on_launch(self, ranks, start_method):
        self.ranks = list(ranks)

    def on_state(self, rank, state):
        self.states.append((rank, state))

    def on_output(self, rank, stream, line):
        self.lines.append((time.time(), rank, stream, line))

    def on_end(self, ok):
        self.ok = ok


def test_output_arrives_while_the_worker_runs_and_observer_sees_states():
    recorder = _Recorder()
    finished_at = notebook_launcher(_output_is_live, num_processes=1, observer=recorder)
    seen_at = next(t for t, _, _, line in recorder.lines if line == "first")
    assert finished_at - seen_at > 1.0
    assert recorder.states == [(0, "running"), (0, "finished")] and recorder.ok is True


def _settings():
    from nbaccel.environment import read_worker_settings
    from nbaccel.state import ProcessState

    s = read_worker_settings()
    return s.mixed_precision, s.launched, s.use_cpu, s.distributed_type, ProcessState().mixed_precision, \
        os.environ["MASTER_ADDR"], os.environ["LOCAL_WORLD_SIZE"], os.environ["NODE_RANK"]


def test_mixed_precision_and_settings_reach_the_workers():
    got = notebook_launcher(_settings, num_processes=2, mixed_precision="bf16")
    assert got == ("bf16", True, True, "MULTI_CPU", "bf16", "127.0.0.1", "2", "0")


def test_config_supplies_values_and_explicit_arguments_win():
    cfg = LaunchConfig(num_processes=3, mixed_precision="fp16")
    assert notebook_launcher(_identity, (0,), config=cfg)["world"] == 3
    assert notebook_launcher(_settings, config=cfg, num_processes=2, mixed_precision="bf16")[0] == "bf16"


def test_bad_argument_is_a_config_error_and_nothing_starts():
    with pytest.raises(ConfigError) as info:
        notebook_launcher(_identity, (0,), num_processes=0)
    assert info.value.key == "num_processes"
    with pytest.raises(ConfigError) as info:
        notebook_launcher(_identity, (0,), num_processes=2, mixed_precision="fp32")
    assert info.value.key == "mixed_precision" and "bf16" in info.value.valid
    with pytest.raises(ConfigError) as info:
        notebook_launcher(_identity, (0,), num_processes=2, hang_timeout=0)
    assert info.value.key == "hang_timeout"
    with pytest.raises(ConfigError) as info:
        notebook_launcher(_identity, (0,), num_processes=2, use_port="twenty")
    assert info.value.key == "use_port" and info.value.value == "twenty"


def test_num_processes_none_picks_a_count_and_says_so(capfd):
    got = notebook_launcher(_identity, (0,))
    _, err = capfd.readouterr()
    expected = max(1, min(len(os.sched_getaffinity(0)), 4))
    assert got["world"] == expected
    assert f"using {expected} CPU processes" in err


def test_debug_launcher_runs_on_cpu_processes():
    assert debug_launcher(_all_reduce) == (2, "MULTI_CPU", "gloo", 3.0)


def _accelerator_leak_check():
    from nbaccel.state import ProcessState

    return ProcessState().num_processes


def test_state_made_before_launch_does_not_leak_into_workers():
    from nbaccel.state import ProcessState

    parent = ProcessState()
    assert parent.num_processes == 1
    assert notebook_launcher(_accelerator_leak_check, num_processes=2) == 2
    assert ProcessState().num_processes == 1


def test_a_returned_module_is_moved_to_cpu_before_it_travels(monkeypatch):
    """A module returned from a GPU would initialize CUDA in the notebook when unpickled there."""
    from nbaccel.launch.payload import dumps_result, loads

    moved = []

    class OnGpu(torch.nn.Linear):
        def cpu(self):
            moved.append(True)
            return super().cpu()

    module = OnGpu(2, 2)
    back = loads(dumps_result({"model": module}))
    assert moved == [True] and isinstance(back["model"], torch.nn.Linear)
