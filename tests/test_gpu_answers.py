"""Which GPUs are here and whether fork is safe: the same answer whatever the process imported first.

Each case runs in a fresh process on a machine that looks, to the dynamic loader, like a GPU
machine (``tests/fake_gpu_driver.py``: NVML and CUDA driver libraries on ``LD_LIBRARY_PATH``).
torch becomes a CUDA build when something imports it (``tests/fake_cuda_on_import.py``), so
"a kernel that has not imported torch yet" is exactly that. Workers are never put on the fake
GPUs: what is checked is what the planner, the CLI and the fork decision answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fake_gpu_driver import build_fake_driver

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_driver(tmp_path_factory.mktemp("fake-driver"))


def _run(driver: Path, script: str, *, cuda_torch: bool = True, args: tuple[str, ...] = (),
         **env: str) -> dict:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LD_LIBRARY_PATH=str(driver), **env)
    if "CUDA_VISIBLE_DEVICES" not in env:
        environ.pop("CUDA_VISIBLE_DEVICES", None)
    prelude = "import tests.fake_cuda_on_import\n" if cuda_torch else ""
    done = subprocess.run([sys.executable, "-c", prelude + script, *args], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_PLAN = r"""
import json, sys
from nbaccel.config import LaunchConfig
from nbaccel.errors import ConfigError
from nbaccel.launch.preflight import plan_launch

out = {"torch_before": "torch" in sys.modules}
one = plan_launch(LaunchConfig(num_processes=1))
out["one"] = [one.device_kind, one.settings.use_cpu, one.settings.distributed_type]
auto = plan_launch(LaunchConfig())
out["auto"] = [auto.device_kind, auto.num_processes, auto.note]
try:
    plan_launch(LaunchConfig(num_processes=3))
except ConfigError as exc:
    out["too_many"] = [exc.key, exc.value, exc.valid]
print(json.dumps(out))
"""


def test_a_process_that_never_imported_torch_launches_on_its_gpus(driver):
    out = _run(driver, _PLAN)
    assert out["torch_before"] is False
    assert out["one"] == ["cuda", False, "NO"]  # was ["cpu", True, "NO"]: training silently on the CPU
    kind, n, note = out["auto"]
    assert (kind, n) == ("cuda", 2) and note == ("nbaccel: using 2 processes, one per visible GPU. Pass "
                                                 "num_processes= to choose.")
    assert out["too_many"] == ["num_processes", 3, "1..2"]  # two ranks on one GPU are refused, never CPU ranks


@pytest.mark.parametrize(("visible", "count"), [("1", 1), ("0,1", 2), ("GPU-fake-1", 1), ("", 0), ("5", 0)])
def test_cuda_visible_devices_is_honoured_without_torch_imported(driver, visible, count):
    script = ("import json, sys\nfrom nbaccel.hardware import cuda_device_count\n"
              "print(json.dumps({'count': cuda_device_count(), 'torch': 'torch' in sys.modules}))")
    out = _run(driver, script, CUDA_VISIBLE_DEVICES=visible)
    assert out == {"count": count, "torch": True}


def test_no_gpu_driver_answers_zero_without_importing_torch():
    script = ("import json, sys\nfrom nbaccel.hardware import cuda_device_count\n"
              "print(json.dumps({'count': cuda_device_count(), 'torch': 'torch' in sys.modules}))")
    out = _run(Path("/nonexistent"), script)
    assert out == {"count": 0, "torch": False}


_CONFIG_DEFAULT = r"""
import json, sys
from nbaccel.cli.main import main
code = main(["config", "--default", "--config_file", sys.argv[1]])
print(json.dumps({"code": code}))
"""


@pytest.mark.parametrize(("gpus", "dtype"), [("2", "MULTI_GPU"), ("1", "NO")])
def test_config_default_on_a_gpu_machine_writes_a_gpu_config(driver, tmp_path, gpus, dtype):
    path = tmp_path / "config.yaml"
    assert _run(driver, _CONFIG_DEFAULT, args=(str(path),), FAKE_NVML_GPUS=gpus) == {"code": 0}
    written = yaml.safe_load(path.read_text())
    assert written["distributed_type"] == dtype and written["use_cpu"] is False
    assert written["num_processes"] == int(gpus)


def test_a_cpu_torch_on_a_gpu_machine_says_why_the_launch_runs_on_cpu(driver):
    script = ("import json\nfrom nbaccel.config import LaunchConfig\nfrom nbaccel.launch.preflight import plan_launch\n"
              "p = plan_launch(LaunchConfig(num_processes=2))\nprint(json.dumps([p.device_kind, p.note]))")
    kind, note = _run(driver, script, cuda_torch=False)
    assert kind == "cpu"
    assert note == ("nbaccel: this machine has 2 GPU(s) (NVIDIA H200), but this torch has no CUDA support, so the "
                    "launch runs on CPU processes. Fix: install a CUDA build of torch.")


# A stand-in for CuPy: importing it initializes the CUDA driver, as `cupy.cuda.runtime.getDeviceCount()` does.
_CUPY = "import ctypes\nctypes.CDLL('libcuda.so.1').cuInit(0)\n"

_FORK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from nbaccel.config import LaunchConfig
from nbaccel.errors import EnvironmentStateError
from nbaccel.hardware import fork_unsafe_reason
from nbaccel.launch.preflight import plan_launch
import ctypes
out = {"fresh": fork_unsafe_reason()}
ctypes.CDLL("libcuda.so.1")  # loaded but not initialized: still safe
out["loaded"] = fork_unsafe_reason()
import cupy
out["cupy"] = fork_unsafe_reason()
plan = plan_launch(LaunchConfig(num_processes=2, use_cpu=True))
out["plan"] = [plan.start_method, plan.note]
try:
    plan_launch(LaunchConfig(num_processes=2, use_cpu=True, start_method="fork"))
except EnvironmentStateError as exc:
    out["forced"] = str(exc)

def rank():
    import os
    return int(os.environ["RANK"]) + 40

from nbaccel import notebook_launcher
out["result"] = notebook_launcher(rank, num_processes=2, use_cpu=True)
print(json.dumps(out))
"""


def test_cuda_initialized_by_another_library_makes_the_launch_spawn_and_names_it(driver, tmp_path, capfd):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(_CUPY)
    out = _run(driver, _FORK, cuda_torch=False, args=(str(tmp_path),))
    assert out["fresh"] is None and out["loaded"] is None
    reason = "CUDA was initialized in this process by CuPy, so forked workers could not use it"
    assert out["cupy"] == reason
    assert out["plan"] == ["spawn", f"nbaccel: starting workers with spawn, not fork: {reason}."]
    assert out["forced"].startswith(f"start_method='fork' is unsafe here: {reason}. Fix: pass start_method='spawn'")
    assert out["result"] == 40  # the launch ran, under spawn, and returned rank 0's value


def test_asking_never_loads_or_initializes_the_driver(driver):
    script = ("import json\nfrom nbaccel.cuda_driver import cuda_driver_state\nfrom nbaccel.hardware import "
              "fork_unsafe_reason, cuda_device_count\nanswers = [fork_unsafe_reason(), cuda_device_count()]\n"
              "s = cuda_driver_state()\nmaps = open('/proc/self/maps').read()\n"
              "print(json.dumps([s.library, s.initialized, 'libcuda' in maps, answers]))")
    assert _run(driver, script) == [None, False, False, [None, 2]]


_PANEL_AND_MAGIC = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
import nbaccel.magics
from nbaccel.widgets.config_panel import _hardware

out = {"torch_before": "torch" in sys.modules, "panel": _hardware().split(" · ")[0]}
shell = InteractiveShell.instance()
nbaccel.magics.load_ipython_extension(shell)
result = shell.run_cell("%%accel_launch -n 3 --status none\nprint('ran')")
out["magic"] = [type(result.error_in_exec).__name__, str(result.error_in_exec).split(". Fix")[0]]
print(json.dumps(out))
"""


def test_the_config_panel_and_the_magic_see_the_gpus_of_a_kernel_without_torch(driver):
    out = _run(driver, _PANEL_AND_MAGIC)
    assert out["torch_before"] is False and out["panel"] == "2 CUDA GPUs"
    assert out["magic"] == ["UsageError", "%%accel_launch: num_processes=3 but only 2 GPU(s) are usable"]
