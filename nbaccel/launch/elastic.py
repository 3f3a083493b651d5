"""Multi-machine launches through torch's elastic agent (an existing, well-tested engine).

Each machine runs one launcher; their agents meet through a c10d (or static) rendezvous and
start their local workers. Failures come back as nbaccel's failure report, root cause first.
The agent installs signal handlers in the calling process and leaves them there; they are
saved and restored around the call.
"""

from __future__ import annotations

import functools
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Iterator

from nbaccel.config import LaunchConfig
from nbaccel.environment import apply_environment, worker_environment
from nbaccel.errors import ConfigError
from nbaccel.launch.failures import WorkerFailure, raise_failures
from nbaccel.launch.preflight import plan_launch, say

__all__ = ["launch_multi_node"]

_HANDLED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED}
    try:
        yield
    finally:
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def _entry(function: Callable[..., Any], env: Mapping[str, str], kwargs: Mapping[str, Any],
           *args: Any) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    import nbaccel.state

    apply_environment(env)
    nbaccel.state.reset_process_state()
    return record(function)(*args, **kwargs)


def _failures(error: Any) -> list[WorkerFailure]:
    out = []
    for rank, failure in error.failures.items():
        data = failure.error_file_data or {}
        info = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
        extra = info.get("extraInfo", {}) if isinstance(info, dict) else {}
        message = info.get("message", "") if isinstance(info, dict) else str(failure.message)
        exc_type, _, text = str(message).partition(": ")
        out.append(WorkerFailure(
            rank=rank, pid=failure.pid, time=float(failure.timestamp), exitcode=failure.exitcode,
            signal=-failure.exitcode if failure.exitcode < 0 else None,
            exc_type=exc_type if text else "", message=text or str(failure.message),
            traceback=extra.get("py_callstack", "")))
    return out


def launch_multi_node(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                      cfg: LaunchConfig, *, master_addr: str, rdzv_backend: str, rdzv_endpoint: str,
                      rdzv_conf: Mapping[str, Any], rdzv_id: str, max_restarts: int, monitor_interval: float,
                      log_line_prefix_template: str | None, return_all: bool) -> Any:
    """Run this machine's share of a multi-machine job.

    Returns:
        ``{global_rank: value}`` for this machine's workers when ``return_all``, else the value of
        global rank 0 when it runs here, or of this machine's first worker.

    Raises:
        ConfigError: the rendezvous settings are incomplete.
        BaseException: the root cause of a worker failure, as in single-machine launches.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    if rdzv_backend not in ("static", "c10d"):
        raise ConfigError(f"rdzv_backend must be 'static' or 'c10d' (got {rdzv_backend!r})",
                          key="rdzv_backend", value=rdzv_backend, valid=("static", "c10d"))
    endpoint = rdzv_endpoint or (f"{cfg.main_process_ip or master_addr}:{cfg.main_process_port}"
                                 if cfg.main_process_port else "")
    if not endpoint:
        raise ConfigError("a multi-machine launch needs a rendezvous endpoint. Fix: pass "
                          "rdzv_endpoint='host:port' (or use_port= with master_addr=).",
                          key="rdzv_endpoint", value=rdzv_endpoint, valid="'host:port'")
    plan = plan_launch(cfg)
    say(plan.note)
    n = plan.num_processes
    conf = dict(rdzv_conf)
    if rdzv_backend == "static":
        conf.setdefault("rank", cfg.machine_rank)
    elastic = ElasticConfig(
        min_nodes=cfg.num_machines, max_nodes=cfg.num_machines, nproc_per_node=n, run_id=rdzv_id,
        rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=conf, max_restarts=max_restarts,
        monitor_interval=monitor_interval, start_method=plan.start_method,
        log_line_prefix_template=log_line_prefix_template or "[rank${rank}]: ")
    env = worker_environment(plan.settings, threads=plan.threads, visible_gpus=plan.visible_gpus)
    entry = functools.update_wrapper(functools.partial(_entry, function, env, dict(kwargs)), function)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    with _signal_handlers_restored(), tempfile.TemporaryDirectory(prefix="nbaccel-elastic-") as logs:
        elastic.logs_specs = DefaultLogsSpecs(log_dir=logs, tee=Std.ALL)
        try:
            results: dict[int, Any] = elastic_launch(elastic, entry)(*args)
        except ChildFailedError as error:
            raise_failures(_failures(error), cfg.num_machines * n)
    by_global = dict(results)  # the agent keys results by global rank
    if return_all:
        return by_global
    return by_global.get(0, by_global[min(by_global)] if by_global else None)
