"""What the notebook tracker costs a training loop: steps/s with it on and off, and the chart's redraws.

One launch of ``--processes`` CPU workers (gloo), watched by the widget status panel (so the
launching process receives every record and redraws the live chart, at most every 0.5 s, on
the same CPUs as the workers). In each worker one small MLP trains under DDP; every step ends
with ``accelerator.log({"loss": ..., "lr": ...}, step=step)``, sent alternately through an
Accelerator with the notebook tracker on and one with it off (``notebook_tracker=False``, where
``log`` has no tracker and returns at once). Rounds interleave on and off, the starting one
alternating, so machine noise hits both alike. We report rank 0's steps/s (the rank that sends):
median [min..max] over rounds for each, and the per-round ratio on/off (goal: >= 0.98x).

Run: ``.venv/bin/python benchmarks/tracking.py [--rounds 15] [--steps 500] [--processes 2] [--no-panel]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn

import nbaccel
from nbaccel.widgets.status_panel import StatusPanel


def train(rounds: int, steps: int) -> dict[str, list[float]]:
    """Runs in every worker: interleaved rounds of ``steps`` steps, logging through either Accelerator."""
    tracked = nbaccel.Accelerator()
    untracked = nbaccel.Accelerator(notebook_tracker=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = tracked.prepare(model, optimizer)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    step = 0

    def run(accelerator: nbaccel.Accelerator, n: int) -> float:
        nonlocal step
        start = time.perf_counter()
        for _ in range(n):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item(), "lr": 0.01}, step=step)
            step += 1
        return n / (time.perf_counter() - start)

    run(untracked, 50)  # warm-up
    for name, accelerator in (("log call on", tracked), ("log call off", untracked)):  # the call alone
        start = time.perf_counter()
        for i in range(2000):
            accelerator.log({"loss": 0.5, "lr": 0.01}, step=step + i)
        rates[name] = [(time.perf_counter() - start) / 2000]
    for index in range(rounds):
        order = [("on", tracked), ("off", untracked)] if index % 2 == 0 else [("off", untracked), ("on", tracked)]
        for name, accelerator in order:
            rates[name].append(run(accelerator, steps))
    return rates


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):8.3f}{unit} [{min(values):.3f}..{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--no-panel", action="store_true", help="no observer: only the records travel")
    args = parser.parse_args()
    panel = StatusPanel(args.processes) if not args.no_panel else None
    with contextlib.redirect_stdout(io.StringIO()):  # the panel's text form, shown when no frontend is attached
        rates = nbaccel.notebook_launcher(train, (args.rounds, args.steps), num_processes=args.processes,
                                          use_cpu=True, observer=panel)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    print(f"{args.processes} CPU processes, {args.rounds} interleaved rounds of {args.steps} steps, "
          "accelerator.log every step; rank 0's steps/s, median [min..max]")
    print(f"  notebook tracker off        {_fmt(rates['off'])}")
    print(f"  notebook tracker on         {_fmt(rates['on'])}")
    print(f"  ratio on/off, per round     {_fmt(ratios, 'x')}   (goal >= 0.98x)")
    call_on, call_off = rates["log call on"][0], rates["log call off"][0]
    step_time = 1 / statistics.median(rates["on"])
    print(f"  one accelerator.log call     on {call_on * 1e6:.1f} us, off {call_off * 1e6:.1f} us: "
          f"{(call_on - call_off) / step_time * 100:.2f}% of a median step ({step_time * 1e3:.2f} ms)")
    print(f"  records received: {len(nbaccel.last_run_history())}; chart redraws: {panel.chart.draws if panel else 0} "
          f"")


if __name__ == "__main__":
    main()
