"""The elastic launcher: multi-machine launches through torch's elastic agent (an existing, well-tested engine).

Each machine runs one launcher; their agents meet through a c10d (or static) rendezvous. Every
worker records its identity from the agent's variables, runs the function, and on failure writes
torch's error file with nbaccel's report in it, so a failure on several machines is raised as on
one. The agent's signal handlers are saved and restored around the call.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from nbaccel.environment import (
    apply_environment,
    read_distributed_env,
    worker_environment,
)
from nbaccel.identity import WorkerIdentity, set_identity
from nbaccel.launch.backend import Backend
from nbaccel.launch.failures import ProcessExit, RankError, WorkerFailure, raise_failures, rank_failure
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.worker.process import describe_error

__all__ = ["BACKEND", "LAUNCHER", "ElasticLauncher"]

_HANDLED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_REPORT_KEY = "nbaccel"


@contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED}
    try:
        yield
    finally:
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def _write_error_file(exc: BaseException) -> None:
    """torch's error file (its ``record`` format), with nbaccel's report of ``exc`` added."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = describe_error(exc)
    pickled = report.pop("exception")
    report["exception"] = base64.b64encode(pickled).decode() if pickled is not None else None
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": report["traceback"], "timestamp": str(int(report["time"])), _REPORT_KEY: report}}}
    with open(path, "w") as handle:
        json.dump(data, handle)


def _entry(lifecycle: RankLifecycle, function: Callable[..., Any], env: Mapping[str, str], kwargs: Mapping[str, Any],
           *args: Any) -> Any:
    """The worker body under the agent: start afresh -> identity -> run -> report (in the error file)."""
    apply_environment(env)
    lifecycle.start_afresh()
    dist = read_distributed_env()
    set_identity(WorkerIdentity.from_distributed_env(dist) if dist is not None else None)
    try:
        return function(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported in the error file, then the worker ends
        _write_error_file(exc)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave now: torch's own `record` wrapper around this entry would overwrite the report.
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


def _failures(error: Any) -> list[WorkerFailure]:
    out = []
    for rank, failure in error.failures.items():
        data = failure.error_file_data or {}
        info = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
        extra = info.get("extraInfo", {}) if isinstance(info, dict) else {}
        ours = extra.get(_REPORT_KEY) if isinstance(extra, dict) else None
        signal_number = -failure.exitcode if failure.exitcode < 0 else None
        if isinstance(ours, dict):
            pickled = ours.get("exception")
            error = RankError.from_frame({**ours, "exception": base64.b64decode(pickled) if pickled else None})
            ended = ProcessExit(exitcode=failure.exitcode, signal=signal_number)
            out.append(rank_failure(rank, failure.pid, ended, error))
            continue
        message = info.get("message", "") if isinstance(info, dict) else str(failure.message)
        exc_type, _, text = str(message).partition(": ")
        out.append(WorkerFailure(
            rank=rank, pid=failure.pid, time=float(failure.timestamp), exitcode=failure.exitcode,
            signal=signal_number, exc_type=exc_type if text else "", message=text or str(failure.message),
            traceback=extra.get("py_callstack", "")))
    return out


class ElasticLauncher:
    """Runs this machine's share of a multi-machine request under torch's elastic agent."""

    name = "elastic"

    def launch(self, request: LaunchRequest) -> dict[int, Any]:
        """``{global_rank: value}`` for this machine's workers, or the root-cause failure raised."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
        from torch.distributed.launcher.api import elastic_launch

        rdzv, cfg, plan = request.rendezvous, request.config, request.plan
        assert rdzv is not None, "build_request sets the rendezvous of every multi-machine request"
        n = plan.num_processes
        elastic = ElasticConfig(
            min_nodes=cfg.num_machines, max_nodes=cfg.num_machines, nproc_per_node=n, run_id=rdzv.run_id,
            rdzv_endpoint=rdzv.endpoint, rdzv_backend=rdzv.backend, rdzv_configs=dict(rdzv.conf),
            max_restarts=rdzv.max_restarts, monitor_interval=rdzv.monitor_interval, start_method=plan.start_method,
            log_line_prefix_template=rdzv.log_line_prefix_template or "[rank${rank}]: ")
        env = worker_environment(plan.settings, threads=plan.threads, visible_gpus=plan.visible_gpus)
        function = request.function
        body = functools.partial(_entry, request.lifecycle, function, env, dict(request.kwargs))
        entry = functools.update_wrapper(body, function)
        with _signal_handlers_restored(), tempfile.TemporaryDirectory(prefix="nbaccel-elastic-") as logs:
            elastic.logs_specs = DefaultLogsSpecs(log_dir=logs, tee=Std.ALL)
            try:
                results: dict[int, Any] = elastic_launch(elastic, entry)(*request.args)
            except ChildFailedError as error:
                raise_failures(_failures(error), cfg.num_machines * n)
        return dict(results)  # the agent keys results by global rank


LAUNCHER = ElasticLauncher()
BACKEND = Backend(LAUNCHER)
