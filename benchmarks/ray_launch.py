"""Launch-to-return on a local Ray for 4 ranks: nbaccel on Ray against the local launcher and Ray Train.

Three ways to run the same work on 4 CPU ranks, interleaved, ``--rounds`` times each:

- ``nbaccel ray``: ``notebook_launcher(fn, num_processes=4, backend="ray", use_cpu=True)``
  (actors and a placement group made and removed per launch);
- ``ray train``: Ray Train's ``TorchTrainer(fn, scaling_config=ScalingConfig(num_workers=4)).fit()``,
  the peer on Ray (``pip install 'ray[train]'``, for this benchmark only);
- ``nbaccel local``: the same ``notebook_launcher`` on this machine's processes (fork), the floor;
- ``nbaccel ray pool``: a ``WorkerPool(4, backend="ray")`` started once, then ``pool.run`` (the warm
  answer on Ray; its start is reported separately).

Two kinds of work: an empty function, and "DDP": build a model, wrap it in DDP and take 20
training steps (nbaccel's ``Accelerator``; Ray Train's ``prepare_model``). Warm figures come from
one process connected to a local Ray instance; first-call figures from a fresh process per
measurement (imports, ``ray.init`` of a new local instance where the library needs one, one
launch). Medians [min..max] in seconds, and ratios of medians.

Ray listens on every interface, so this runs in a loopback-only network namespace: the script
re-executes itself through ``scripts/loopback_namespace.py`` (needs root).

Run: ``.venv/bin/python benchmarks/ray_launch.py [--rounds 5] [--fresh-rounds 3]``.

Figures (2026-12-04, this 2-core machine, 4 CPU ranks, ``--rounds 5 --fresh-rounds 3``; seconds,
median [min..max]; ratios of medians)::

    warm, empty     nbaccel ray 2.43 [2.29..2.57]   ray train 11.61 [10.93..12.09]  -> 0.21x
                    nbaccel local 0.029             ray pool run 0.083 [0.081..0.135]
    warm, ddp       nbaccel ray 6.49 [6.43..6.89]   ray train 18.44 [17.30..18.71]  -> 0.35x
                    nbaccel local 0.787             ray pool run 0.277 [0.221..0.312]
    fresh, empty    nbaccel ray 7.82 [7.53..8.02]   ray train 21.40 [20.48..22.81]  -> 0.37x
    fresh, ddp      nbaccel ray 11.28 [11.23..11.53] ray train 25.66 [25.07..26.01] -> 0.44x
    WorkerPool(4, backend="ray") start: 5.6 s

A second run 50 minutes later (same command) found every Ray figure about 2x slower for both
libraries (local ones unchanged), with the ratios holding: warm empty 5.77 vs 20.22 -> 0.29x, warm
ddp 9.86 vs 31.52 -> 0.31x, fresh empty 0.39x, fresh ddp 0.43x, pool run / local ddp 0.30x. Trust
the ratios, not the absolute seconds, on a shared 2-core machine.

Run 3, after every rank's actor imports torch.distributed at once (commit daf92e7; the machine in
its slower state, like run 2): warm empty 6.42 [5.97..6.77] vs 18.63 -> 0.34x (an empty function
now pays 4 torch imports on 2 cores), warm ddp 8.71 [8.53..9.11] vs 29.84 -> 0.29x, fresh empty
16.17 vs 39.34 -> 0.41x, fresh ddp 18.26 vs 44.53 -> 0.41x, pool run / local ddp 0.33x, pool start
5.3 s.

A one-shot launch on Ray pays for new actor processes (each imports torch and joins the group);
the pool pays that once, after which a DDP run returns faster than a local fork launch.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
RANKS = 4
STEPS = 20


def empty() -> int:
    return 1


def ddp_nbaccel() -> float:
    import torch

    from nbaccel import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
    return float(loss)


def ddp_ray_train() -> None:
    import torch
    from ray import train
    from ray.train.torch import prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    train.report({"loss": float(loss)})


def empty_ray_train() -> None:
    pass


def run_nbaccel(backend: str, work: str) -> None:
    from nbaccel import notebook_launcher

    function = ddp_nbaccel if work == "ddp" else empty
    notebook_launcher(function, num_processes=RANKS, use_cpu=True, backend=backend)


def run_ray_train(work: str) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    function = ddp_ray_train if work == "ddp" else empty_ray_train
    storage = tempfile.mkdtemp(prefix="raytrain-")
    TorchTrainer(function, scaling_config=ScalingConfig(num_workers=RANKS, use_gpu=False),
                 run_config=RunConfig(storage_path=storage)).fit()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _ratio(a: list[float], b: list[float]) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x"


class Driver:
    """One library's long-lived driver process, connected to the shared Ray instance; runs on request.

    Each library gets a process of its own (as in a notebook, one kernel per user), so one library's
    leftovers in a driver (Ray Train keeps its controller actors) never slow another's launches.
    """

    def __init__(self, library: str, address: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", library, "--address", address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        self.started = float(self._reply())  # seconds the driver's own setup took (the pool's start)

    def _reply(self) -> str:
        line = self.process.stdout.readline().strip()
        if not line or line.startswith("error"):
            raise RuntimeError(f"driver failed: {line or 'exited'}")
        return line

    def time(self, work: str) -> float:
        self.process.stdin.write(work + "\n")
        self.process.stdin.flush()
        return float(self._reply())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def serve(library: str, address: str) -> None:
    """The driver side: read a work name per line, run it once, answer with the seconds it took."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    started = time.perf_counter()
    pool = None
    if library != "nbaccel local":
        import ray

        ray.init(address=address, log_to_driver=False, configure_logging=False)
    if library == "nbaccel ray pool":
        from nbaccel import WorkerPool

        pool = WorkerPool(RANKS, use_cpu=True, backend="ray")
    runs: dict[str, Callable[[str], object]] = {
        "nbaccel ray": lambda work: run_nbaccel("ray", work),
        "ray train": run_ray_train,
        "nbaccel local": lambda work: run_nbaccel("local", work),
        "nbaccel ray pool": lambda work: pool.run(ddp_nbaccel if work == "ddp" else empty),
    }
    channel.write(f"{time.perf_counter() - started}\n")
    for line in sys.stdin:
        try:
            channel.write(f"{_timed(functools.partial(runs[library], line.strip()))}\n")
        except Exception as error:  # noqa: BLE001 - reported to the parent, which stops
            channel.write(f"error: {type(error).__name__}: {error}\n".replace("\n", " ") + "\n")
    if pool is not None:
        pool.close()


COLUMNS = ("nbaccel ray", "ray train", "nbaccel local", "nbaccel ray pool")


def warm(rounds: int) -> None:
    import ray

    # Logical CPUs for the pool's ranks, a launch's and Ray Train's (which also runs a controller).
    context = ray.init(num_cpus=3 * RANKS + 2, log_to_driver=False, configure_logging=False)
    drivers = {name: Driver(name, context.address_info["gcs_address"]) for name in COLUMNS}
    try:
        for work in ("empty", "ddp"):
            for driver in drivers.values():  # one untimed call each: imports, Ray's worker start
                driver.time(work)
            times: dict[str, list[float]] = {name: [] for name in COLUMNS}
            for _ in range(rounds):
                for name, driver in drivers.items():
                    times[name].append(driver.time(work))
            print(f"\nwarm, {work} ({RANKS} ranks, {rounds} interleaved rounds, one driver process per library;"
                  " seconds, median [min..max])")
            for name in COLUMNS:
                print(f"  {name:17s} {_spread(times[name])}")
            print(f"  nbaccel ray / ray train        {_ratio(times['nbaccel ray'], times['ray train'])}")
            print(f"  nbaccel ray / nbaccel local    {_ratio(times['nbaccel ray'], times['nbaccel local'])}")
            print(f"  ray pool run / ray train       {_ratio(times['nbaccel ray pool'], times['ray train'])}")
            print(f"  ray pool run / nbaccel local   {_ratio(times['nbaccel ray pool'], times['nbaccel local'])}")
        started = drivers["nbaccel ray pool"].started
        print(f"\nWorkerPool(4, backend='ray') start (actors, process group): {started:.3f} s")
    finally:
        for driver in drivers.values():
            driver.close()
        ray.shutdown()


_FRESH = {
    "nbaccel ray": "import ray; ray.init(num_cpus={n}, log_to_driver=False, configure_logging=False); "
                   "from benchmarks.ray_launch import run_nbaccel; run_nbaccel('ray', '{work}')",
    "ray train": "import ray; ray.init(num_cpus={n}, log_to_driver=False, configure_logging=False); "
                 "from benchmarks.ray_launch import run_ray_train; run_ray_train('{work}')",
    "nbaccel local": "from benchmarks.ray_launch import run_nbaccel; run_nbaccel('local', '{work}')",
}


def fresh(rounds: int) -> None:
    root = Path(__file__).resolve().parent.parent
    for work in ("empty", "ddp"):
        times: dict[str, list[float]] = {name: [] for name in _FRESH}
        for _ in range(rounds):
            for name, code in _FRESH.items():
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", code.format(n=RANKS, work=work)], cwd=root, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
                times[name].append(time.perf_counter() - start)
        print(f"\nfirst call in a fresh process, {work} (process start to exit, local Ray instance started inside;"
              f" {rounds} interleaved rounds)")
        for name in _FRESH:
            print(f"  {name:17s} {_spread(times[name])}")
        print(f"  nbaccel ray / ray train        {_ratio(times['nbaccel ray'], times['ray train'])}")
        print(f"  nbaccel ray / nbaccel local    {_ratio(times['nbaccel ray'], times['nbaccel local'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the warm figures")
    parser.add_argument("--fresh-rounds", type=int, default=3, help="interleaved rounds of the fresh-process figures")
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh-process figures")
    parser.add_argument("--serve", choices=COLUMNS, help=argparse.SUPPRESS)  # a driver process (internal)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        serve(args.serve, args.address)
        return
    if [name for _, name in socket.if_nameindex()] != ["lo"]:  # Ray must not see this machine's network
        here = Path(__file__).resolve()
        helper = here.parent.parent / "scripts" / "loopback_namespace.py"
        os.execv(sys.executable, [sys.executable, str(helper), sys.executable, str(here), *sys.argv[1:]])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    warm(args.rounds)
    if not args.no_fresh:
        fresh(args.fresh_rounds)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
