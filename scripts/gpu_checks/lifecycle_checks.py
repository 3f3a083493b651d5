"""Checks of launches as a whole on GPUs: choosing GPUs, a failing rank, an interrupt, the magics, fp8,
and launching after this process touched CUDA.

The last two checks query and then initialize CUDA here on purpose (so they run last): the
launches must then switch from fork to spawn and still work. The failure and interrupt checks
read NVML to see that the workers' GPU memory came back.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import torch

from gpu_checks import workers
from gpu_checks.runner import Check, expect, launch, registrar

__all__ = ["CHECKS"]

CHECKS: list[Check] = []
check = registrar(CHECKS)


@check("gpu-ids", min_gpus=2)
def _gpu_ids(gpus: int) -> str:
    from nbaccel import LaunchConfig

    first = launch(workers.uuid, n=1, config=LaunchConfig(gpu_ids="0"))[0]
    last = launch(workers.uuid, n=1, config=LaunchConfig(gpu_ids=str(gpus - 1)))[0]
    by_uuid = launch(workers.uuid, n=1, config=LaunchConfig(gpu_ids=last))[0]
    expect(first != last and by_uuid == last, f"gpu_ids 0 -> {first}, {gpus - 1} -> {last}, {last} -> {by_uuid}")
    return f"gpu_ids='0', '{gpus - 1}' and a UUID select the GPUs they name"


def _nvml_used() -> list[int]:
    from ctypes import CDLL, Structure, byref, c_int, c_ulonglong, c_void_p

    class Memory(Structure):
        _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]

    nvml = CDLL("libnvidia-ml.so.1")
    nvml.nvmlInit_v2()
    count = c_int(0)
    nvml.nvmlDeviceGetCount_v2(byref(count))
    used = []
    for index in range(count.value):
        handle, memory = c_void_p(), Memory()
        nvml.nvmlDeviceGetHandleByIndex_v2(index, byref(handle))
        nvml.nvmlDeviceGetMemoryInfo(handle, byref(memory))
        used.append(memory.used)
    return used


def _memory_back(before: list[int], slack: int = 256 * 2**20, wait: float = 15.0) -> str:
    deadline = time.monotonic() + wait
    while True:
        now = _nvml_used()
        extra = max(a - b for a, b in zip(now, before))
        if extra < slack or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    expect(extra < slack, f"{extra / 2**20:.0f} MiB of GPU memory still held after the launch")
    return f"GPU memory back within {max(extra, 0) / 2**20:.0f} MiB"


@check("failing-rank")
def _failing(gpus: int) -> str:
    before = _nvml_used()
    with tempfile.TemporaryDirectory() as folder:
        try:
            launch(workers.hold_memory_then, folder, gpus - 1, n=gpus)
            raise AssertionError("the failing rank's error was not raised")
        except ValueError as exc:
            expect(f"rank {gpus - 1} fails" in str(exc), exc)
    return f"rank {gpus - 1}'s ValueError raised here, the others stopped; " + _memory_back(before)


@check("interrupt")
def _interrupt(gpus: int) -> str:
    before = _nvml_used()
    with tempfile.TemporaryDirectory() as folder:
        def interrupt_when_ready() -> None:
            deadline = time.monotonic() + 120
            while len(os.listdir(folder)) < gpus and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)

        # A background job starts with SIGINT ignored; Jupyter's Interrupt button needs Python's handler.
        saved = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=interrupt_when_ready, daemon=True).start()
        try:
            launch(workers.hold_memory_then, folder, None, n=gpus)
            raise AssertionError("the interrupt was not raised")
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGINT, saved)
    return "KeyboardInterrupt raised here, every worker stopped; " + _memory_back(before)


@check("magics")
def _magics(gpus: int) -> str:
    from IPython.core.interactiveshell import InteractiveShell

    import nbaccel.magics

    shell = InteractiveShell.instance()
    nbaccel.magics.load_ipython_extension(shell)
    result = shell.run_cell(f"%%accel_launch -n {gpus} -o total --status none\n"
                            "import torch\nfrom nbaccel import Accelerator\nacc = Accelerator()\n"
                            "total = acc.reduce(torch.ones(1, device=acc.device), 'sum').item()\n"
                            "device = str(acc.device)\n")
    expect(result.error_in_exec is None, result.error_in_exec)
    expect(shell.user_ns.get("total") == gpus, f"total {shell.user_ns.get('total')}")
    return f"%%accel_launch -n {gpus} -o total: reduce over GPUs gave {shell.user_ns['total']:g} in the notebook"


@check("fp8")
def _fp8(gpus: int) -> str:
    from nbaccel.errors import ConfigError, MissingDependencyError

    try:
        loss, converted = launch(workers.fp8_train, n=gpus, mixed_precision="fp8")[0]
    except (ConfigError, MissingDependencyError) as refused:  # decided before any worker started
        expect(not torch.cuda.is_initialized(), "refusing fp8 initialized CUDA")
        return f"refused at launch: {str(refused).split('. Fix')[0]}"
    expect(loss == loss and converted > 0, f"loss {loss}, Float8Linear layers {converted}")
    return f"torchao fp8 training: {converted} Float8Linear layer(s), loss {loss:.4f}"


@check("returned-module")
def _returned(gpus: int) -> str:
    from nbaccel.hardware import fork_unsafe_reason

    module = launch(workers.cuda_module, n=1)[0]
    device = next(module.parameters()).device
    expect(device.type == "cpu" and not torch.cuda.is_initialized() and fork_unsafe_reason() is None,
           f"module on {device}, CUDA initialized here: {torch.cuda.is_initialized()}")
    return "a CUDA nn.Module returned by a worker arrives on CPU; CUDA untouched here"


@check("spawn-after-cuda-query")
def _after_query(gpus: int) -> str:
    from nbaccel.hardware import fork_unsafe_reason

    torch._C._cuda_getDeviceCount()  # what torch.cuda.is_available() does without NVML: poisons fork
    reason = fork_unsafe_reason()
    expect(reason is not None and "queried" in reason and not torch.cuda.is_initialized(), f"reason {reason!r}")
    results = launch(workers.all_reduce, n=gpus)
    expect(all(v[2] == gpus * (gpus + 1) / 2 for v in results.values()), results)
    return "a parent that only queried CUDA is seen (probe fork); the launch spawned and NCCL worked"


@check("spawn-after-cuda-init")
def _after_init(gpus: int) -> str:
    from nbaccel.hardware import fork_unsafe_reason

    torch.zeros(1, device="cuda")
    expect("initialized" in (fork_unsafe_reason() or ""), fork_unsafe_reason())
    results = launch(workers.all_reduce, n=gpus)
    expect(all(v[2] == gpus * (gpus + 1) / 2 for v in results.values()), results)
    return "CUDA initialized here: the launch spawned and NCCL worked"
