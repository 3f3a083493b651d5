"""``scripts/check_gpu.py`` on a CPU machine: its plan, its report lines, and its worker code on CPU processes.

The GPU assertions run only on a GPU machine; here the script's own logic (which checks run on
how many GPUs, one line per check, failures not stopping the run) and the training code it
launches (on 2 gloo processes) are checked, so the first GPU session can run it as is.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nbaccel import LaunchConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_gpu.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP) [a-z0-9-]+ \S")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_gpu"] = module  # forked workers find the launched functions here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("check_gpu", None)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_check(script):
    done = _run("--help")
    assert done.returncode == 0
    assert all(c.name in "".join(done.stdout.split()) for c in script.CHECKS)  # argparse wraps at hyphens


@pytest.mark.parametrize("gpus", [1, 4])
def test_dry_run_prints_one_line_per_check(script, gpus):
    done = _run("--dry-run", "--gpus", str(gpus))
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == len(script.CHECKS) + 1
    assert all(LINE.match(text) for text in lines[:-1])
    two_gpu = {c.name for c in script.CHECKS if c.min_gpus > 1}
    assert two_gpu == {"fsdp2", "fsdp2-cpu-offload", "device-map-tied", "gpu-ids"}
    needs = {text.split()[1] for text in lines if "needs 2+ GPUs" in text}
    assert needs == (two_gpu if gpus == 1 else set())


def test_without_a_gpu_every_check_is_skipped_and_the_exit_says_so(script):
    done = _run()
    assert done.returncode == 2
    assert done.stdout.splitlines() == [f"SKIP {c.name} no CUDA GPU visible" for c in script.CHECKS]


def test_a_failing_check_is_reported_and_the_next_still_runs(script):
    def fails(gpus):
        script.expect(False, "wrong\nvalue")

    def skips(gpus):
        raise script.Skip("not here")

    checks = [script.Check("a", fails), script.Check("b", skips), script.Check("c", lambda g: "fine"),
              script.Check("d", lambda g: "never", min_gpus=8)]
    lines: list[str] = []
    counts = script.run_checks(checks, 2, out=lines.append)
    assert counts == {"PASS": 1, "FAIL": 1, "SKIP": 2}
    assert lines[0].startswith("FAIL a AssertionError: wrong value (") and lines[1] == "SKIP b not here"
    assert lines[2].startswith("PASS c fine (") and lines[3] == "SKIP d needs 8+ GPUs (have 2)"


def test_the_launched_training_code_runs_on_cpu_processes(script):
    for own_generator in (False, True):
        orders = list(script.launch(script.workers.shuffled, own_generator, n=2).values())
        assert orders[0] == orders[1] and sorted(orders[0]) == list(range(64))
    synced, spread = script.launch(script.workers.accumulate, n=2)[0]
    assert synced[:4] == [False, True, False, True] and spread < 1e-6
    gap, refused = script.launch(script.workers.fp16_clipping, n=2)[0]
    assert gap < 5e-2 and refused == "refused"
    with tempfile.TemporaryDirectory() as folder:
        gap, steps_on, _ = script.launch(script.workers.save_load, folder, n=2)[0]
    assert gap < 1e-5 and steps_on == "cpu"
    config = LaunchConfig(distributed_type="FSDP", use_cpu=True,
                          fsdp_config={"fsdp_state_dict_type": "FULL_STATE_DICT"})
    backend, norm, keys = script.launch(script.workers.fsdp, n=2, config=config)[0]
    assert backend == "gloo" and norm == norm and keys == 4


def test_a_failing_rank_is_seen_by_its_check(script):
    with tempfile.TemporaryDirectory() as folder, pytest.raises(ValueError, match="rank 1 fails on purpose"):
        script.launch(script.workers.hold_memory_then, folder, 1, n=2)


def test_an_unknown_check_name_is_refused_with_the_valid_ones():
    done = _run("--only", "nccl-all-reduce,warp-drive", "--dry-run")
    assert done.returncode == 2 and "unknown check(s) ['warp-drive']" in done.stderr and "'fp8'" in done.stderr
    assert _run("--only", "fp8,gpu-ids", "--dry-run", "--gpus", "2").stdout.splitlines()[:2] == [
        "SKIP gpu-ids dry run (would run on 2 GPU(s))", "SKIP fp8 dry run (would run on 2 GPU(s))"]


def test_the_entry_point_and_each_checks_module_stay_small_and_say_what_they_do():
    files = [SCRIPT, *sorted((SCRIPT.parent / "gpu_checks").glob("*.py"))]
    sizes = {p.name: len(p.read_text().splitlines()) for p in files}
    assert len(files) >= 5 and max(sizes.values()) < 400, sizes
    for path in files:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{path.name} has no docstring saying what it does"


def test_the_pinned_load_worker_finds_a_checkpoint_loaded_as_load_state_dict_loads_it(script):
    """On CPU the load maps and copies instead of staging; the comparison code is the GPU check's."""
    with tempfile.TemporaryDirectory() as folder:
        found = script.model_checks.pinned_load(folder, "cpu", width=64, wide=96)
    assert found["stored"] == ([], True) and found["float16"] == ([], True)
    assert found["stored tied"] and found["float16 tied"] and found["chunked exact"]
    assert found["pinned bytes"] is None  # only a CUDA device allocates pinned staging buffers


def test_first_use_checks_run_their_code_on_a_cpu_machine(script):
    """The fresh-process, config-default and warm-rank checks' programs run here and give the CPU answers."""
    from gpu_checks import first_use_checks as first

    device, available, grad = first._last_json(first._python(first._FRESH))
    assert (device, available, grad) == ("cpu", False, "cpu")
    with tempfile.TemporaryDirectory() as folder:
        code, written = first._last_json(first._python(first._CONFIG, str(Path(folder) / "c.yaml")))
    assert code == 0 and written["use_cpu"] is True
    runs, _times, fresh = first._last_json(first._python(first._WARM))
    assert len({pid for pid, _, _ in runs}) == 1 and {d for _, d, _ in runs} == {"cpu"} and fresh[0] != runs[0][0]
    names = [c.name for c in script.CHECKS]
    assert names[:5] == ["fresh-process-launch", "config-default", "cupy-first", "warm-one-gpu", "notebooks"]


def test_the_streaming_checks_pass_on_cpu_so_a_gpu_session_can_run_them_as_they_are():
    """``check_gpu_loading.py --cpu`` runs the streamed-offload checks' own logic (order, wrap-around,
    pinned cap, bit-identity) with synchronous copies; the CUDA-only parts skip themselves."""
    loading = SCRIPT.parent / "check_gpu_loading.py"
    done = subprocess.run([sys.executable, str(loading), "--cpu", "--mib", "16"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith("ok   ") for line in lines), lines
    assert any("prefetch order" in line for line in lines) and any("wrap-around" in line for line in lines)
    assert any("pinned slabs stay under the cap" in line for line in lines)
    # batches big enough that compute overlaps copies, and the order on a transformers decoder
    assert sum("(compute overlapping copies) bit-identical" in line for line in lines) == 3
    assert any("a decoder layer is one group" in line for line in lines)
    assert any("generate(): every step after the first copies each group once" in line for line in lines)
    assert any(line.startswith("ok   offload_report after generate()") for line in lines)
