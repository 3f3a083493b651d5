"""Check nbaccel's CUDA paths on a machine with NVIDIA GPUs (1 or several); this repository's CI has none.

Run ``python scripts/check_gpu.py`` (or ``%run`` it in a notebook). It prints one line per
check, ``PASS|FAIL|SKIP <name> <detail>``, and exits 1 if any check failed, 2 when no GPU is
visible. Checks that need two GPUs say ``SKIP`` on one. ``--only a,b`` runs some checks;
``--dry-run [--gpus N]`` prints the plan without touching CUDA (what the CPU test suite runs).
The whole run takes 2-4 minutes on 1-8 GPUs.

Order matters: every check up to ``returned-module`` keeps CUDA untouched in this process
(work happens in launched workers, so fork stays possible); the last two query and then
initialize CUDA here on purpose, and check that launches switch to spawn and still work.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAUNCH_TIMEOUT = 150.0
CHECKS: list[Check] = []


class Skip(Exception):
    """Raised by a check that cannot run here (its message says why)."""


@dataclass(frozen=True)
class Check:
    """One named check: ``run(gpus)`` returns a detail string, raises :class:`Skip`, or fails."""

    name: str
    run: Callable[[int], str]
    min_gpus: int = 1


def check(name: str, min_gpus: int = 1) -> Callable[[Callable[[int], str]], Callable[[int], str]]:
    def register(function: Callable[[int], str]) -> Callable[[int], str]:
        CHECKS.append(Check(name, function, min_gpus))
        return function
    return register


def line(status: str, name: str, detail: object = "") -> str:
    """The one line a check prints: ``STATUS name detail`` on one line."""
    text = " ".join(str(detail).split())
    return f"{status} {name} {text[:400]}".rstrip()


def run_checks(checks: list[Check], gpus: int, *, dry_run: bool = False,
               out: Callable[[str], None] = print) -> dict[str, int]:
    """Run ``checks`` in order on ``gpus`` GPUs, printing one line each; returns the count of each status."""
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for item in checks:
        start = time.monotonic()
        if item.min_gpus > gpus:
            status, detail = "SKIP", f"needs {item.min_gpus}+ GPUs (have {gpus})"
        elif dry_run:
            status, detail = "SKIP", f"dry run (would run on {gpus} GPU(s))"
        else:
            try:
                status, detail = "PASS", item.run(gpus)
            except Skip as skip:
                status, detail = "SKIP", str(skip)
            except BaseException as exc:  # noqa: BLE001 - a failed check is reported, the next one runs
                if isinstance(exc, (SystemExit, KeyboardInterrupt)) and item.name != "interrupt":
                    raise
                status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        took = "" if dry_run or status == "SKIP" else f" ({time.monotonic() - start:.1f}s)"
        out(line(status, item.name, f"{detail}{took}"))
        counts[status] += 1
    return counts


def expect(condition: bool, message: object) -> None:
    """Fail the current check with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(str(message))


def launch(function: Callable[..., Any], *args: Any, n: int, **options: Any) -> dict[int, Any]:
    """Every rank's result; workers' output is hidden (errors still come back)."""
    from nbaccel import notebook_launcher

    return notebook_launcher(function, args, num_processes=n, return_all=True, timeout=LAUNCH_TIMEOUT,
                             output_ranks=(), **options)


# --------------------------------------------------------------------------- what workers run


def _all_reduce() -> tuple[int, str, float]:
    import torch.distributed as dist

    from nbaccel import ProcessState

    state = ProcessState()
    if not dist.is_initialized():  # one GPU: a one-rank NCCL group, so NCCL itself is exercised
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1,
                                device_id=state.device)
    value = torch.ones(1, device=state.device) * (state.process_index + 1)
    dist.all_reduce(value)
    return state.process_index, str(state.device), value.item()


def _shuffled(seed_generator: bool) -> list[int]:
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator

    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(5) if seed_generator else None
    loader = accelerator.prepare(DataLoader(torch.arange(64), batch_size=4, shuffle=True, generator=generator))
    seen = [accelerator.gather(batch).cpu().tolist() for batch in loader]
    return [i for part in seen for i in part]


def _model_data(width: int = 16) -> tuple[nn.Module, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 1))
    data = TensorDataset(torch.randn(128, width), torch.randn(128, 1))
    return model, DataLoader(data, batch_size=8)


def _accumulate() -> tuple[list[bool], float]:
    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, loader = _model_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    synced, spread = [], 0.0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            grad = next(model.parameters()).grad.detach().flatten()
            both = accelerator.gather(grad[None])
            if accelerator.sync_gradients:  # after the all-reduce every rank holds the same gradient
                spread = max(spread, float((both - both[0]).abs().max()))
            synced.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    return synced, spread


def _train(mixed_precision: str, clip_every: bool = False, steps: int | None = None) -> torch.Tensor:
    from nbaccel import Accelerator, GradScalerKwargs

    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=2,
                              kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model, loader = _model_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if clip_every or accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        if steps is not None and step + 1 >= steps:
            break
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def _precisions() -> dict[str, float]:
    reference = _train("no")
    return {mp: float((_train(mp) - reference).abs().max()) for mp in ("fp16", "bf16")}


def _fp16_clipping() -> tuple[float, str]:
    from nbaccel.errors import EnvironmentStateError

    gap = float((_train("fp16") - _train("no")).abs().max())
    try:
        _train("fp16", clip_every=True)
        refused = "not refused"
    except EnvironmentStateError:
        refused = "refused"
    return gap, refused


def _save_load(folder: str) -> tuple[float, str, str]:
    from nbaccel import Accelerator

    def build() -> tuple[Any, Any, Any]:
        accelerator = Accelerator(mixed_precision="fp16")
        model, _ = _model_data()
        return (accelerator, *accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01)))

    def steps(acc: Any, model: Any, optimizer: Any, first: int) -> torch.Tensor:
        for step in range(first, first + 3):  # the same batches before and after the resume
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)
            acc.backward(nn.functional.mse_loss(model(x.to(acc.device)), y.to(acc.device)))
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

    acc, model, optimizer = build()
    steps(acc, model, optimizer, 0)
    acc.save_state(folder)
    expected = steps(acc, model, optimizer, 3)
    acc2, model2, optimizer2 = build()
    acc2.load_state(folder)
    step_devices = {str(s["step"].device) for s in optimizer2.state.values()}
    moment_devices = {str(s["exp_avg"].device) for s in optimizer2.state.values()}
    got = steps(acc2, model2, optimizer2, 3)
    return float((got - expected).abs().max()), ",".join(sorted(step_devices)), ",".join(sorted(moment_devices))


def _fsdp() -> tuple[str, float, int]:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    model, loader = _model_data(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norm = torch.zeros(())
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device)))
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    full = accelerator.get_state_dict(model)
    return accelerator.state.backend, float(norm), len(full)


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 256, blocks: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _device_map_tied() -> tuple[dict[str, Any], bool, bool]:
    from nbaccel import dispatch_model, infer_auto_device_map

    torch.manual_seed(0)
    model = _TiedLM().eval()
    ids = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        expected = model(ids)
    size = sum(p.numel() * 4 for p in model.parameters())
    budget = {0: int(size * 0.6), 1: int(size * 0.6), "cpu": 10 * size}
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Sequential"])
    model = dispatch_model(model, device_map)
    with torch.no_grad():
        got = model(ids.to("cuda:0")).cpu()
    tied = model.head.weight is model.embed.weight
    return {str(k): str(v) for k, v in device_map.items()}, bool(torch.allclose(got, expected, atol=1e-4)), tied


def _offload(folder: str) -> tuple[dict[str, Any], bool]:
    from safetensors.torch import save_file

    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch

    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    path = os.path.join(folder, "model.safetensors")
    save_file(full.state_dict(), path)
    with init_empty_weights():
        empty = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    model = load_checkpoint_and_dispatch(empty, path, device_map="auto", max_memory={0: "600KiB", "cpu": "600KiB"},
                                         offload_folder=os.path.join(folder, "offload"))
    x = torch.randn(4, 256)
    with torch.no_grad():
        same = torch.allclose(model(x.cuda()).cpu(), full(x), atol=1e-5)
    return {str(k): str(v) for k, v in model.hf_device_map.items()}, bool(same)


def _uuid() -> str:
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _hold_memory_then(folder: str, fail_rank: int | None) -> None:
    from nbaccel import ProcessState

    state = ProcessState()
    block = torch.empty(512 * 2**20 if state.device.type == "cuda" else 1024, dtype=torch.uint8, device=state.device)  # 512 MiB each
    block.fill_(1)
    open(os.path.join(folder, f"ready{state.process_index}"), "w").close()
    if state.process_index == fail_rank:
        raise ValueError(f"rank {fail_rank} fails on purpose")
    time.sleep(600)  # stopped by the launcher (a failing rank, or the caller's interrupt)


def _fp8_train() -> tuple[float, int]:
    from nbaccel import Accelerator

    accelerator = Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        loss = model(torch.randn(32, 64, device=accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return float(loss), converted


def _cuda_module() -> nn.Module:
    return nn.Linear(4, 4).cuda()


# --------------------------------------------------------------------------- the checks, in order


@check("gpu-count")
def _count(gpus: int) -> str:
    from nbaccel.cuda_probe import cuda_fork_poisoned, nvml_gpus

    expect(gpus > 0 and not torch.cuda.is_initialized() and not cuda_fork_poisoned(),
           f"{gpus} GPUs; CUDA initialized={torch.cuda.is_initialized()}")
    info = nvml_gpus()
    names = sorted({f"{g.name} (sm{g.capability[0]}{g.capability[1]})" for g in info[1]}) if info else ["NVML n/a"]
    return f"{gpus} GPU(s) counted without touching CUDA: {', '.join(names)}; driver {info[0] if info else '?'}"


@check("helpers-keep-fork-safe")
def _helpers(gpus: int) -> str:
    import nbaccel
    from nbaccel.hardware import fork_unsafe_reason
    from nbaccel.training.random import capture_rng_state

    nbaccel.set_seed(0)
    accelerator = nbaccel.Accelerator()
    accelerator.free_memory()
    capture_rng_state()
    reason = fork_unsafe_reason()
    expect(reason is None and not torch.cuda.is_initialized(), f"fork unsafe after helpers: {reason}")
    return f"set_seed, Accelerator() (device {accelerator.device}), free_memory, capture_rng_state: fork still safe"


@check("nccl-all-reduce")
def _nccl(gpus: int) -> str:
    results = launch(_all_reduce, n=gpus)
    expected = gpus * (gpus + 1) / 2
    expect(all(v[2] == expected for v in results.values()), results)
    expect(len({v[1] for v in results.values()}) == gpus, f"devices {[v[1] for v in results.values()]}")
    return f"{gpus} rank(s), one device each, sum {expected:g} (launched with fork)"


@check("shuffled-loader")
def _loader(gpus: int) -> str:
    for own_generator in (False, True):
        results = launch(_shuffled, own_generator, n=gpus)
        orders = list(results.values())
        expect(all(o == orders[0] for o in orders), "ranks gathered different orders")
        expect(sorted(orders[0]) == list(range(64)) and orders[0] != list(range(64)),
               f"not a shuffle of 0..63: {orders[0][:8]}...")
    return "shuffle=True with and without a generator: every sample once, same order on every rank"


@check("accumulation-no-sync")
def _accumulation(gpus: int) -> str:
    synced, spread = launch(_accumulate, n=gpus)[0]
    expect(synced[:4] == [False, True, False, True], f"sync pattern {synced[:4]}")
    expect(spread < 1e-6, f"ranks' gradients differ by {spread:g} after the sync step")
    return f"{len(synced)} micro-steps, optimizer every 2nd, synced gradients equal across ranks"


@check("mixed-precision")
def _precision(gpus: int) -> str:
    gaps = launch(_precisions, n=gpus)[0]
    expect(all(gap < 5e-2 for gap in gaps.values()), gaps)
    return "fp16 (GradScaler) and bf16 weights within 5e-2 of fp32: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items())


@check("fp16-clipping")
def _clipping(gpus: int) -> str:
    gap, refused = launch(_fp16_clipping, n=gpus)[0]
    expect(gap < 5e-2 and refused == "refused", f"gap {gap:g}, clipping on a non-sync step {refused}")
    return f"clip at sync steps matches fp32 ({gap:.1e}); clipping a non-sync micro-step refused"


@check("save-load-state")
def _save_load_state(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        gap, steps_on, moments_on = launch(_save_load, folder, n=gpus)[0]
    expect(gap < 1e-5, f"resumed weights differ by {gap:g}")
    expect(steps_on == "cpu" and moments_on.startswith("cuda"), f"Adam step on {steps_on}, moments on {moments_on}")
    return f"fp16 Adam resumed exactly; step counters on {steps_on}, moments on {moments_on}"


def _fsdp_check(gpus: int, offload: bool) -> str:
    from nbaccel import LaunchConfig

    config = LaunchConfig(distributed_type="FSDP", fsdp_config={"fsdp_offload_params": offload,
                                                               "fsdp_state_dict_type": "FULL_STATE_DICT"})
    backend, norm, keys = launch(_fsdp, n=gpus, config=config)[0]
    expect(norm == norm and keys == 4, f"norm {norm}, full state dict keys {keys}")
    if offload:
        expect(backend == "cuda:nccl,cpu:gloo", f"backend {backend!r}")
    return f"FSDP2 over {gpus} GPUs, backend {backend}, clip_grad_norm_ {norm:.3f}, full state dict gathered"


@check("fsdp2", min_gpus=2)
def _fsdp2(gpus: int) -> str:
    return _fsdp_check(gpus, offload=False)


@check("fsdp2-cpu-offload", min_gpus=2)
def _fsdp2_offload(gpus: int) -> str:
    return _fsdp_check(gpus, offload=True)


@check("device-map-tied", min_gpus=2)
def _tied(gpus: int) -> str:
    device_map, same, tied = launch(_device_map_tied, n=1)[0]
    used = set(device_map.values())
    expect({"0", "1"} <= used and same, f"map {device_map}, output matches {same}")
    return (f"tied-embedding model over {sorted(used)}; output matches CPU; head and embedding "
            f"{'still share one Parameter' if tied else 'hold separate copies'}")


@check("big-model-offload")
def _big_model(gpus: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        device_map, same = launch(_offload, folder, n=1)[0]
    expect(same and {"0", "cpu", "disk"} <= set(device_map.values()), f"map {device_map}, matches {same}")
    return "device_map='auto' over GPU, CPU and disk; output matches the full model"


@check("gpu-ids", min_gpus=2)
def _gpu_ids(gpus: int) -> str:
    from nbaccel import LaunchConfig

    first = launch(_uuid, n=1, config=LaunchConfig(gpu_ids="0"))[0]
    last = launch(_uuid, n=1, config=LaunchConfig(gpu_ids=str(gpus - 1)))[0]
    by_uuid = launch(_uuid, n=1, config=LaunchConfig(gpu_ids=last))[0]
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
            launch(_hold_memory_then, folder, gpus - 1, n=gpus)
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
            launch(_hold_memory_then, folder, None, n=gpus)
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
        loss, converted = launch(_fp8_train, n=gpus, mixed_precision="fp8")[0]
    except (ConfigError, MissingDependencyError) as refused:  # decided before any worker started
        expect(not torch.cuda.is_initialized(), "refusing fp8 initialized CUDA")
        return f"refused at launch: {str(refused).split('. Fix')[0]}"
    expect(loss == loss and converted > 0, f"loss {loss}, Float8Linear layers {converted}")
    return f"torchao fp8 training: {converted} Float8Linear layer(s), loss {loss:.4f}"


@check("returned-module")
def _returned(gpus: int) -> str:
    from nbaccel.hardware import fork_unsafe_reason

    module = launch(_cuda_module, n=1)[0]
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
    results = launch(_all_reduce, n=gpus)
    expect(all(v[2] == gpus * (gpus + 1) / 2 for v in results.values()), results)
    return "a parent that only queried CUDA is seen (probe fork); the launch spawned and NCCL worked"


@check("spawn-after-cuda-init")
def _after_init(gpus: int) -> str:
    from nbaccel.hardware import fork_unsafe_reason

    torch.zeros(1, device="cuda")
    expect("initialized" in (fork_unsafe_reason() or ""), fork_unsafe_reason())
    results = launch(_all_reduce, n=gpus)
    expect(all(v[2] == gpus * (gpus + 1) / 2 for v in results.values()), results)
    return "CUDA initialized here: the launch spawned and NCCL worked"


def main(argv: list[str] | None = None) -> int:
    """Run the checks; the exit status is 0 (all passed or skipped), 1 (a failure) or 2 (no GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated check names: " + ", ".join(c.name for c in CHECKS))
    parser.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    parser.add_argument("--gpus", type=int, help="with --dry-run: plan for this many GPUs")
    args = parser.parse_args(argv)
    chosen = CHECKS
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {c.name for c in CHECKS})
        if unknown:
            parser.error(f"unknown check(s) {unknown}; valid: {[c.name for c in CHECKS]}")
        chosen = [c for c in CHECKS if c.name in names]
    from nbaccel.hardware import cuda_device_count

    gpus = args.gpus if args.dry_run and args.gpus is not None else cuda_device_count()
    if gpus == 0 and not args.dry_run:
        for item in chosen:
            print(line("SKIP", item.name, "no CUDA GPU visible"))
        return 2
    counts = run_checks(chosen, gpus, dry_run=args.dry_run)
    print(f"# {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped on {gpus} GPU(s)")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
