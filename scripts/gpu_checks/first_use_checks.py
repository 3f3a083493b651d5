"""Checks of what a new user meets first on a GPU machine, each in a fresh Python process.

- ``fresh-process-launch``: a process that has never imported torch launches one rank, which
  must train on ``cuda:0`` (it used to plan a CPU launch without a word).
- ``config-default``: ``nbaccel config --default`` writes a GPU config.
- ``cupy-first``: CuPy initializing CUDA first makes the launch spawn (named in its note), and
  the launch still works (skipped where CuPy is not installed).
- ``warm-one-gpu``: repeated one-process launches reuse the warm rank on ``cuda:0`` (same pid),
  each starts with no GPU memory of the last one allocated, and a launch takes milliseconds
  after the first; ``fresh=True`` still starts a new process.
- ``notebooks``: every notebook but the TPU and Ray ones runs headless, top to bottom, unchanged
  (skipped where nbclient / ipykernel are missing: see ENV.md for bringing them).

Each runs in a subprocess, so this process's CUDA stays untouched (fork stays possible for the
checks after these).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_checks.runner import Check, Skip, expect, registrar

__all__ = ["CHECKS"]

CHECKS: list[Check] = []
check = registrar(CHECKS)
ROOT = Path(__file__).resolve().parents[2]
_NOTEBOOK_TIMEOUT = 240


def _python(code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def _last_json(done: subprocess.CompletedProcess) -> object:
    expect(done.returncode == 0, f"exit {done.returncode}: {done.stderr[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_FRESH = r"""
import json, sys
assert "torch" not in sys.modules
from nbaccel import notebook_launcher

def where():
    import torch
    from nbaccel import Accelerator
    acc = Accelerator()
    x = torch.ones(4, device=acc.device, requires_grad=True)
    (x * 2).sum().backward()
    return [str(acc.device), torch.cuda.is_available(), x.grad.device.type]

print(json.dumps(notebook_launcher(where, num_processes=1)))
"""


@check("fresh-process-launch")
def _fresh(gpus: int) -> str:
    device, available, grad = _last_json(_python(_FRESH))
    expect(device == "cuda:0" and available and grad == "cuda", f"worker device {device}, grad on {grad}")
    return "a process that never imported torch launched a rank that trained on cuda:0"


_CONFIG = r"""
import json, sys, yaml
from nbaccel.cli.main import main
code = main(["config", "--default", "--config_file", sys.argv[1]])
print(json.dumps([code, yaml.safe_load(open(sys.argv[1]))]))
"""


@check("config-default")
def _config(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        code, written = _last_json(_python(_CONFIG, str(Path(folder) / "config.yaml")))
    dtype = "MULTI_GPU" if gpus > 1 else "NO"
    expect(code == 0 and written["use_cpu"] is False and written["distributed_type"] == dtype
           and written["num_processes"] == gpus, written)
    return f"nbaccel config --default wrote distributed_type={dtype}, num_processes={gpus}, use_cpu=false"


_CUPY = r"""
import io, json, contextlib
import cupy
cupy.cuda.runtime.getDeviceCount()   # initializes the CUDA driver in this process
from nbaccel import notebook_launcher
from nbaccel.hardware import fork_unsafe_reason

def where():
    from nbaccel import Accelerator
    return str(Accelerator().device)

err = io.StringIO()
with contextlib.redirect_stderr(err):
    device = notebook_launcher(where, num_processes=1)
print(json.dumps([fork_unsafe_reason(), err.getvalue(), device]))
"""


@check("cupy-first")
def _cupy(gpus: int) -> str:
    if importlib.util.find_spec("cupy") is None:
        raise Skip("CuPy is not installed")
    reason, note, device = _last_json(_python(_CUPY))
    expect(reason is not None and "CuPy" in reason, f"reason {reason!r}")
    expect("starting workers with spawn, not fork" in note and device == "cuda:0", f"note {note!r}, device {device}")
    return f"CuPy first: {reason}; the launch spawned and ran on {device}"


_WARM = r"""
import json, os, time
from nbaccel import notebook_launcher

def step(size):
    import torch
    from nbaccel import Accelerator
    acc = Accelerator()
    before = torch.cuda.memory_allocated()
    model = acc.prepare(torch.nn.Linear(size, size))
    loss = model(torch.ones(8, size, device=acc.device)).sum()
    acc.backward(loss)
    return [os.getpid(), str(acc.device), before]

times, runs = [], []
for _ in range(6):
    start = time.perf_counter()
    runs.append(notebook_launcher(step, (1024,), num_processes=1))
    times.append(time.perf_counter() - start)
fresh = notebook_launcher(step, (1024,), num_processes=1, fresh=True)
print(json.dumps([runs, times, fresh]))
"""


@check("warm-one-gpu")
def _warm(gpus: int) -> str:
    runs, times, fresh = _last_json(_python(_WARM))
    pids = {pid for pid, _, _ in runs}
    expect(len(pids) == 1 and all(device == "cuda:0" for _, device, _ in runs), f"runs {runs}")
    expect(all(before == 0 for _, _, before in runs), f"GPU memory left by an earlier launch: {runs}")
    expect(fresh[0] not in pids and fresh[1] == "cuda:0", f"fresh run {fresh}")
    later = sorted(times[1:])[len(times[1:]) // 2]
    return f"6 launches on one warm rank (pid {pids.pop()}): first {times[0]:.3f}s, then median {later * 1000:.1f} ms"


_NOTEBOOKS = ("01_quickstart", "02_training", "03_big_model_inference", "05_scripts_and_cli", "06_warm_workers")


@check("notebooks")
def _notebooks(gpus: int) -> str:
    missing = [m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"{', '.join(missing)} not installed (ENV.md: bring the wheels and put them on PYTHONPATH)")
    done, failed = [], []
    for name in _NOTEBOOKS:
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_notebook.py"),
                              str(ROOT / "notebooks" / f"{name}.ipynb"), "--timeout", str(_NOTEBOOK_TIMEOUT)],
                             capture_output=True, text=True, timeout=_NOTEBOOK_TIMEOUT + 60, cwd=ROOT)
        sys.stdout.write(f"# {name}: exit {run.returncode}\n{run.stdout[-3000:]}{run.stderr[-2000:]}\n")
        (done if run.returncode == 0 else failed).append(name)
    expect(not failed, f"failed: {failed}")
    return f"{len(done)} notebooks ran top to bottom on {gpus} GPU(s)"
