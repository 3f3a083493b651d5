"""`nbaccel test`: a short distributed sanity run with the configured setup, and a plain verdict.

Every worker joins the process group the way ``Accelerator()`` would (through
:class:`nbaccel.process_state.ProcessState`), checks that nbaccel's settings reached it, runs an
``all_reduce`` and one DDP training step, and checks that every rank ends with the same weights.
The last line says ``works`` or ``FAILED`` and why.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from nbaccel.cli.launch_cmd import (
    Terminated,
    add_launch_flags,
    launch_function,
    report_failure,
    resolve_config,
)
from nbaccel.errors import LaunchTimeoutError

__all__ = ["register", "sanity_check"]

_DEFAULT_TIMEOUT = 120.0
_HANG_TIMEOUT = 30.0


def _ddp_step(state: Any) -> float:
    """One DDP step on a tiny model with rank-dependent data; returns the weights' spread across ranks."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(4, 1).to(state.device)
    if state.use_distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((8, 4), float(state.process_index + 1), device=state.device)
    model(x).pow(2).mean().backward()
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = torch.zeros_like(weights)
    if state.use_distributed:
        low, high = weights.clone(), weights.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        spread = high - low
    del model, optimizer
    return float(spread.abs().max())


def sanity_check() -> dict[str, Any]:
    """What one worker runs: process group, settings, all_reduce, a DDP step. Raises on a wrong result.

    Example:
        In a plain process, a world of one (the device and backend are the machine's):

        >>> sanity_check()["world_size"]  # doctest: +ELLIPSIS
        rank 0/1 on ... process group, all_reduce and a DDP step work
        1
    """
    import torch
    import torch.distributed as dist

    from nbaccel.environment import read_worker_settings
    from nbaccel.process_state import ProcessState

    state = ProcessState()
    settings = read_worker_settings()
    value = torch.tensor([float(state.process_index + 1)], device=state.device)
    if state.use_distributed:
        dist.all_reduce(value)
    n = state.num_processes
    expected = n * (n + 1) / 2
    if float(value.item()) != expected:
        raise RuntimeError(f"all_reduce gave {value.item()} on rank {state.process_index}, expected {expected}")
    spread = _ddp_step(state)
    if spread > 1e-6:
        raise RuntimeError(f"after one DDP step the ranks' weights differ by {spread:g}: gradients were not averaged")
    print(f"rank {state.process_index}/{n} on {state.device} ({state.backend}): process group, "
          "all_reduce and a DDP step work", flush=True)
    result = {"world_size": n, "device": str(state.device), "backend": state.backend,
              "mixed_precision": settings.mixed_precision, "distributed_type": state.distributed_type}
    state.destroy_process_group()
    return result


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel test`` to the command line."""
    parser = subparsers.add_parser(
        "test", help="check that distributed runs work with the configured setup",
        description="Run a short distributed sanity check (process group, all_reduce, one DDP step) with the "
                    "config in effect, and say plainly whether it works.")
    add_launch_flags(parser)
    parser.set_defaults(func=run)


def _verdict(results: Any, cfg: Any, seconds: float) -> str:
    first = results.get(0) or next(iter(results.values()))
    world = first["world_size"]
    return (f"nbaccel test: works. {world} process(es) on {cfg.num_machines} machine(s), "
            f"{first['device'].split(':')[0]} over {first['backend']}, {first['distributed_type']}, "
            f"mixed_precision={first['mixed_precision']}, {seconds:.1f}s.")


def run(args: argparse.Namespace) -> int:
    """Run the check; 0 when it works, 1 when it does not."""
    cfg, note = resolve_config(args)
    if note:
        print(note, file=sys.stderr, flush=True)
    if cfg.timeout is None:
        cfg = cfg.with_overrides(timeout=_DEFAULT_TIMEOUT)
    started = time.monotonic()
    try:
        results = launch_function(sanity_check, (), cfg, hang_timeout=_HANG_TIMEOUT, return_all=True)
    except (KeyboardInterrupt, Terminated):
        raise
    except LaunchTimeoutError as exc:
        print(f"nbaccel test: FAILED: the check did not finish ({exc.reason}).\n{exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # any worker failure is the verdict
        code = report_failure(exc, "nbaccel test", trim=False)
        if code is None:
            raise
        print("nbaccel test: FAILED: see the root cause above. `nbaccel env` prints the details to include "
              "in a bug report.", file=sys.stderr, flush=True)
        return 1
    print(_verdict(results, cfg, time.monotonic() - started), flush=True)
    return 0
