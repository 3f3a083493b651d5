"""Launch overhead: nbaccel against Accelerate's notebook_launcher, torch elastic_launch and mp.spawn.

For 2 and 4 CPU processes, each launcher runs the same function (join a gloo group, one
all_reduce, leave); it records when it entered and left. We report the time until the last worker
is in the function, the time until the launcher returns, and the launcher's own share of that
(before the last entry plus after the last exit), medians of ``--repeat`` interleaved rounds, and
ratios.

Then the first launches in a fresh process (each run in a new interpreter that has imported torch
but launched nothing yet), 4 CPU workers, nbaccel against Accelerate's ``notebook_launcher`` in the
same run: a trivial function's first launch (goal <= 1.0x Accelerate's), a function that makes an
``Accelerator`` and gathers one tensor (goal <= 1.0x), and a DDP training
function's first and second launches (goals <= 0.5x and <= 0.25x). The machine's load average
is printed with the figures: CPU time here is shared.

Then a repeated one-process launch of a small training function (an ``Accelerator``, a two-layer
model prepared with its optimizer, 5 steps), each variant in a fresh process: its first call, and
its warm steady state (the median of calls 3 to ``--calls``), against Accelerate's
``notebook_launcher``, which runs a one-process function in the calling process (goal: steady
state <= 2x Accelerate's). Rows: ``nbaccel (default)``, and ``nbaccel fresh=True`` where
``notebook_launcher`` takes ``fresh`` (a new process for every launch).

Run: ``.venv/bin/python benchmarks/launch.py`` (needs ``pip install accelerate`` for its column);
``--only-first`` runs only the fresh-process tables.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


def work(marks: str) -> None:
    """The benchmarked function: note the entry time, then one collective."""
    entered = time.time()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    Path(marks, f"{os.environ.get('RANK', '0')}-{os.getpid()}").write_text(f"{entered!r} {time.time()!r}")


def trivial() -> int:
    """A function that builds nothing: its launch is pure launcher overhead."""
    return 1


def ddp_train(steps: int = 5) -> float:
    """A small DDP training loop over gloo (what a notebook's first real launch does)."""
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    value = float(loss)
    del model, optimizer
    dist.destroy_process_group()
    return value


def gather_nbaccel() -> int:
    """Make an Accelerator and gather one tensor (an evaluation cell's first launch), with nbaccel."""
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    return int(accelerator.gather(torch.ones(1, device=accelerator.device)).sum())


def gather_accelerate() -> int:
    """The same function, with Accelerate's Accelerator (``cpu=True``: else each CPU worker runs alone)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    return int(accelerator.gather(torch.ones(1, device=accelerator.device)).sum())


def small_train_nbaccel() -> float:
    """A small training function (what a notebook re-runs while trying things), with nbaccel."""
    from nbaccel import Accelerator

    return _small_train(Accelerator(cpu=True))


def small_train_accelerate() -> float:
    """The same function, with Accelerate's Accelerator."""
    from accelerate import Accelerator

    return _small_train(Accelerator(cpu=True))


def _small_train(accelerator: Any, steps: int = 5) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(steps):
        loss = model(torch.randn(16, 32, device=accelerator.device)).pow(2).mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
    return float(loss.detach())


ONE_PROCESS_VARIANTS = ("nbaccel (default)", "nbaccel fresh=True", "accelerate")


def _one_process_variants() -> list[str]:
    """The rows this install can run: ``fresh=True`` only where ``notebook_launcher`` takes it."""
    from nbaccel import notebook_launcher

    variants = list(ONE_PROCESS_VARIANTS)
    if "fresh" not in inspect.signature(notebook_launcher).parameters:
        variants.remove("nbaccel fresh=True")
    return variants


def _child_repeated(variant: str, calls: int) -> None:
    """In a fresh interpreter: time ``calls`` one-process launches of the small training function."""
    if variant == "accelerate":
        from accelerate import notebook_launcher as acc_launch

        def run() -> None:
            acc_launch(small_train_accelerate, num_processes=1)
    else:
        from nbaccel import notebook_launcher as nb_launch

        extra = {"fresh": True} if variant == "nbaccel fresh=True" else {}

        def run() -> None:
            nb_launch(small_train_nbaccel, num_processes=1, use_cpu=True, **extra)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"first": times[0], "steady": statistics.median(times[2:])}))


def one_process_launches(repeat: int, calls: int) -> None:
    """The repeated one-process table: each variant in a new interpreter per round, variants interleaved."""
    variants = _one_process_variants()
    got: dict[str, list[dict[str, float] | None]] = {variant: [] for variant in variants}
    for round_index in range(repeat):
        for variant in variants[round_index % len(variants):] + variants[:round_index % len(variants)]:
            got[variant].append(_fresh_run("repeated", variant, calls))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nrepeated one-process launches of a small training function, CPU (median [min..max] of {repeat} "
          f"fresh processes; steady = each process's median of calls 3-{calls}; ratio = row / accelerate, "
          f"pairwise by round; load average {load})")
    print(f"{'launcher':20} {'first call (s)':>22} {'steady state (s)':>24} {'ratio first':>18} {'ratio steady':>20}")
    peer = got["accelerate"]
    for variant in variants:
        runs = [(ours, theirs) for ours, theirs in zip(got[variant], peer) if ours and theirs]
        if not runs:
            continue
        first, steady = [r["first"] for r, _ in runs], [r["steady"] for r, _ in runs]
        ratio_first = [a["first"] / b["first"] for a, b in runs]
        ratio_steady = [a["steady"] / b["steady"] for a, b in runs]
        print(f"{variant:20} {_spread(first):>22} {_spread(steady, 4):>24} {_spread(ratio_first, 1):>18} "
              f"{_spread(ratio_steady, 1):>20}")
    print("goal: nbaccel (default) steady state <= 2x accelerate")


def _child(launcher: str, function_name: str, n: int) -> None:
    """In a fresh interpreter: time the first and the second launch of one function."""
    function = {"trivial": trivial, "ddp": ddp_train,
                "gather": gather_nbaccel if launcher == "nbaccel" else gather_accelerate}[function_name]
    if launcher == "nbaccel":
        from nbaccel import notebook_launcher as nb_launch

        def run() -> None:
            nb_launch(function, num_processes=n, use_cpu=True)
    else:
        from accelerate import notebook_launcher as acc_launch

        def run() -> None:
            acc_launch(function, num_processes=n, use_port=str(_free_port()))
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    run()
    print(json.dumps({"first": first, "second": time.perf_counter() - start}))


def compile_bytecode() -> str:
    """Byte-compile nbaccel's modules where they are imported from, as installing a package does.

    Accelerate's modules were compiled when pip installed them; a source checkout run with
    ``PYTHONDONTWRITEBYTECODE=1`` (as on this machine) would otherwise compile every nbaccel
    module again in every fresh process, 60-110 ms of a first launch here, which no installed
    copy pays. Returns the line saying so.
    """
    import compileall

    import nbaccel

    root = Path(nbaccel.__file__).parent
    compileall.compile_dir(root, quiet=1)
    return f"bytecode: nbaccel's compiled in {root}/**/__pycache__ (Accelerate's by pip, at install)"


def first_launches(n: int, repeat: int) -> None:
    """The fresh-process table: each measurement in a new interpreter, launchers interleaved."""
    cases = [(launcher, fn) for fn in ("trivial", "gather", "ddp") for launcher in ("nbaccel", "accelerate")]
    got: dict[tuple[str, str], list[dict[str, float] | None]] = {case: [] for case in cases}
    hung: list[str] = []
    for round_index in range(repeat):
        for launcher, fn in cases[round_index % 2:] + cases[:round_index % 2]:
            got[(launcher, fn)].append(_fresh_run(launcher, fn, n))
            if got[(launcher, fn)][-1] is None:
                hung.append(f"{launcher} {fn} (round {round_index + 1})")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nfirst launches in a fresh process, {n} CPU workers (median [min..max] of {repeat}; the ratio's "
          f"spread is over rounds, each round's runs back to back; load average {load})")
    print(f"{'function':9} {'launch':7} {'nbaccel (s)':>22} {'accelerate (s)':>22} {'ratio':>18} {'goal':>7}")
    goals = {("trivial", "first"): 1.0, ("gather", "first"): 1.0, ("ddp", "first"): 0.5, ("ddp", "second"): 0.25}
    for (fn, which), goal in goals.items():
        pairs = [(a[which], b[which]) for a, b in zip(got[("nbaccel", fn)], got[("accelerate", fn)]) if a and b]
        if not pairs:
            continue
        ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        ratios = [a / b for a, b in pairs]
        print(f"{fn:9} {which:7} {_spread(ours):>22} {_spread(theirs):>22} {_spread(ratios, 2):>18} "
              f"{'<= ' + str(goal):>7}")
    if hung:  # a hung run is a finding, not a figure: its round is left out of that row
        print(f"hung past 300 s and left out: {', '.join(hung)}")


def _fresh_run(launcher: str, fn: str, n: int, timeout: float = 300) -> dict[str, float] | None:
    """One fresh-process measurement; ``None`` when it hung past ``timeout`` (its whole group is killed).

    ``launcher`` ``"repeated"`` runs :func:`_child_repeated` (``fn`` the variant, ``n`` the calls).
    """
    child = subprocess.Popen([sys.executable, __file__, "--child", launcher, fn, str(n)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.communicate()
        return None
    if child.returncode != 0:
        raise SystemExit(f"{launcher} {fn} failed:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _spread(values: list[float], digits: int = 3) -> str:
    """``median [min..max]``: a figure the next run does not reproduce is not a result."""
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}..{max(values):.{digits}f}]")


def _spawn_entry(local_rank: int, marks: str, n: int, port: int) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    work(marks)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nbaccel_fork(n: int, marks: str) -> None:
    from nbaccel import notebook_launcher

    notebook_launcher(work, (marks,), num_processes=n, start_method="fork")


def nbaccel_spawn(n: int, marks: str) -> None:
    from nbaccel import notebook_launcher

    notebook_launcher(work, (marks,), num_processes=n, start_method="spawn")


def accelerate_fork(n: int, marks: str) -> None:
    from accelerate import notebook_launcher

    notebook_launcher(work, (marks,), num_processes=n, use_port=str(_free_port()))


def elastic_fork(n: int, marks: str) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, rdzv_backend="static",
                          rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_configs={"rank": 0},
                          max_restarts=0, monitor_interval=0.1, start_method="fork", run_id="bench")
    elastic_launch(config, work)(marks)


def mp_spawn(n: int, marks: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_spawn_entry, args=(marks, n, _free_port()), nprocs=n, start_method="spawn")


LAUNCHERS: dict[str, Callable[[int, str], None]] = {
    "nbaccel fork": nbaccel_fork,
    "nbaccel spawn": nbaccel_spawn,
    "accelerate notebook_launcher": accelerate_fork,
    "torch elastic_launch (fork)": elastic_fork,
    "torch.multiprocessing spawn": mp_spawn,
}


def measure(launch: Callable[[int, str], None], n: int) -> tuple[float, float, float]:
    """One run: seconds until every worker entered, until the launcher returned, and the launcher's own share.

    The launcher's share is the time before the last worker entered the function plus the time
    from the last worker leaving it to the launcher returning: what remains when the function's
    own work (here, process-group setup and teardown) is taken out.
    """
    with tempfile.TemporaryDirectory() as marks:
        start = time.time()
        launch(n, marks)
        end = time.time()
        spans = [tuple(map(float, p.read_text().split())) for p in Path(marks).iterdir()]
    assert len(spans) == n, f"expected {n} workers, saw {len(spans)}"
    last_in, last_out = max(s[0] for s in spans), max(s[1] for s in spans)
    return last_in - start, end - start, (last_in - start) + (end - last_out)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=12, help="launches per process in the one-process table")
    parser.add_argument("--only-first", action="store_true",
                        help="only the fresh-process tables (first launches, repeated one-process launches)")
    parser.add_argument("--child", nargs=3, metavar=("LAUNCHER", "FUNCTION", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "repeated":
            return _child_repeated(args.child[1], int(args.child[2]))
        return _child(args.child[0], args.child[1], int(args.child[2]))
    try:
        import accelerate  # noqa: F401 - only whether it imports
    except ImportError:
        print("accelerate not installed: its column is skipped (pip install accelerate)", file=sys.stderr)
        LAUNCHERS.pop("accelerate notebook_launcher")
    else:
        print(compile_bytecode())
        first_launches(4, args.repeat)
        one_process_launches(args.repeat, args.calls)
    if args.only_first:
        return
    for launch in LAUNCHERS.values():  # warm-up: first-use imports are not launch overhead
        measure(launch, 2)
    for n in args.processes:
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in LAUNCHERS}
        for round_index in range(args.repeat):  # interleaved, starting launcher rotating: noise hits all alike
            names = list(LAUNCHERS)
            names = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in names:
                runs[name].append(measure(LAUNCHERS[name], n))
        rows = {name: tuple(statistics.median(r[k] for r in got) for k in range(3)) for name, got in runs.items()}
        base_in, base_out, base_own = rows["nbaccel fork"]
        print(f"\n{n} processes (median of {args.repeat} interleaved rounds; ratio = that launcher / nbaccel fork)")
        print(f"{'launcher':32} {'all in fn (s)':>14} {'returned (s)':>13} {'launcher share (s)':>19} "
              f"{'ratio in':>9} {'ratio ret':>10} {'ratio share':>12}")
        for name, (t_in, t_out, own) in rows.items():
            print(f"{name:32} {t_in:14.3f} {t_out:13.3f} {own:19.3f} {t_in / base_in:9.2f} {t_out / base_out:10.2f} "
                  f"{own / base_own:12.2f}")
        spawn_ratio = rows["nbaccel spawn"][1] / rows["torch.multiprocessing spawn"][1]
        print(f"nbaccel spawn / torch.multiprocessing spawn (returned): {spawn_ratio:.2f} (goal <= 1.1)")
        if "accelerate notebook_launcher" in rows:
            peer = rows["accelerate notebook_launcher"]
            print(f"nbaccel fork / accelerate (returned): {base_out / peer[1]:.2f} (goal <= 0.5); "
                  f"launcher share alone: {base_own / peer[2]:.2f}")


if __name__ == "__main__":
    main()
