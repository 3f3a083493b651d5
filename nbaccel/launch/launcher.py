"""`notebook_launcher` and `debug_launcher`: run a function on N worker processes from anywhere.

The signature is Accelerate's, so existing notebooks run unchanged; nbaccel adds keywords for the
start method, a timeout and hang watchdog, which ranks' output to show, every rank's result, and
a status observer. Where we differ from Accelerate we do so on purpose:

- the function's return value comes back (rank 0's, or ``{rank: value}`` with ``return_all``);
- ``mixed_precision`` and the other settings really reach the workers;
- a free loopback port is picked for every launch instead of always 29500;
- on a CPU-only machine the workers form one gloo job without ``Accelerator(cpu=True)``;
- when fork is unsafe (CUDA initialized in the notebook) we spawn instead of refusing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nbaccel.config import LaunchConfig, StartMethod
from nbaccel.environment import DistributedEnv, MixedPrecision, worker_environment
from nbaccel.errors import ConfigError
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.output import OutputRelay
from nbaccel.launch.preflight import LaunchPlan, plan_launch, say
from nbaccel.launch.rendezvous import LoopbackStore
from nbaccel.launch.starter import SpawnFiles, start_forked, start_spawned
from nbaccel.launch.supervisor import Supervisor

__all__ = ["debug_launcher", "notebook_launcher"]

_warmed = False


def _warm_imports() -> None:
    """Import what every DDP worker would import itself (torch._dynamo: ~2 s each) once, here."""
    global _warmed
    if not _warmed and "torch" in sys.modules:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401
        _warmed = True


def _check_ranks(output_ranks: Iterable[int] | int | None, n: int) -> frozenset[int] | None:
    if output_ranks is None:
        return None
    ranks = frozenset([output_ranks] if isinstance(output_ranks, int) else output_ranks)
    bad = sorted(r for r in ranks if not isinstance(r, int) or not 0 <= r < n)
    if bad:
        raise ConfigError(f"output_ranks names rank {bad[0]!r}, but ranks run from 0 to {n - 1}. Fix: "
                          f"pass ranks in 0..{n - 1}, or None to show every rank.", key="output_ranks",
                          value=sorted(ranks, key=str), valid=list(range(n)))
    return ranks


def _check_single_machine_options(**given: Any) -> None:
    """Refuse options that only nbaccel's own supervisor honours, before a multi-machine launch."""
    used = [name for name, value in given.items() if value is not None]
    if used:
        raise ConfigError(f"{used[0]} is not supported for multi-machine launches (num_nodes > 1): those run "
                          "under torch's elastic agent, which streams every rank's output and has no timeout or "
                          f"status events. Fix: drop {used[0]}, or launch on one machine.", key=used[0],
                          value=given[used[0]], valid=None)


def _port_number(use_port: int | str | None) -> int | None:
    if use_port in (None, ""):
        return None
    try:
        return int(use_port)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"use_port must be a port number from 1 to 65535, or None for a free one (got "
                          f"{use_port!r}). Fix: pass use_port=None, or a number such as 29500.", key="use_port",
                          value=use_port, valid="1..65535 or None") from None


def _resolve(config: LaunchConfig | None, **explicit: Any) -> LaunchConfig:
    base = config if config is not None else LaunchConfig()
    return base.with_overrides(**explicit)


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int | None = None,
    num_nodes: int | None = None,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    start_method: StartMethod | None = None,
    timeout: float | None = None,
    hang_timeout: float | None = 120.0,
    output_ranks: Iterable[int] | int | None = None,
    return_all: bool = False,
    use_cpu: bool | None = None,
    config: LaunchConfig | None = None,
    observer: LaunchObserver | None = None,
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` workers and return its result.

    Each worker gets torchrun's variables and nbaccel's settings, so ``Accelerator()`` (or a bare
    ``init_process_group()``) inside the function joins one job. What workers print appears live,
    labelled ``[rankN]:``; the first failing rank's exception is raised here with its remote
    traceback; an interrupt stops every worker. Nothing is left running afterwards.

    Args:
        function: the function to run in every worker.
        args: positional arguments for it.
        num_processes: workers on this machine; ``None`` uses the GPUs found, the TPU cores, or
            (CPU-only) one per core up to 4, and says so.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; ``None`` takes the config's.
        use_port: the rendezvous port; ``None`` picks a free one (Accelerate always uses 29500).
        master_addr: machine 0's address for multi-node runs (single-machine runs use loopback).
        node_rank: this machine's rank in a multi-node run.
        num_nodes: machines taking part; more than one goes through torch's elastic agent.
        rdzv_backend: ``"static"`` or ``"c10d"`` (multi-node).
        rdzv_endpoint: ``host:port`` of the rendezvous (multi-node).
        rdzv_conf: extra rendezvous settings (multi-node).
        rdzv_id: the job id shared by all machines (multi-node).
        max_restarts: restarts the elastic agent may make (multi-node).
        monitor_interval: seconds between the elastic agent's checks (multi-node).
        log_line_prefix_template: the elastic agent's output prefix (multi-node).
        kwargs: keyword arguments for ``function``.
        start_method: ``"fork"``, ``"spawn"`` or ``None`` (fork when safe).
        timeout: stop the launch after this many seconds (raises ``LaunchTimeoutError``).
        hang_timeout: when some ranks have finished and the rest print nothing for this many
            seconds, dump their stacks and stop them; ``None`` disables the watchdog. Single-machine
            launches only: a multi-machine launch runs under torch's elastic agent, which ignores
            this and refuses ``timeout``, ``output_ranks`` and ``observer``.
        output_ranks: show only these ranks' output (results and errors still come back).
        return_all: return ``{rank: value}`` instead of rank 0's value.
        use_cpu: run on CPU processes even where GPUs exist.
        config: a :class:`LaunchConfig` supplying every value not given here.
        observer: receives per-rank state and output events (the status panel).

    Returns:
        Rank 0's return value (moved to CPU), or ``{rank: value}`` when ``return_all``.

    Raises:
        ConfigError: an argument is invalid; nothing was started.
        EnvironmentStateError: ``start_method="fork"`` but fork is unsafe here.
        PayloadPicklingError: under spawn, the function or an argument cannot be pickled.
        LaunchTimeoutError: ``timeout`` passed or the watchdog fired.
        KeyboardInterrupt: the caller was interrupted; every worker was stopped.
        BaseException: the root-cause worker's own exception, with ``launch_failures`` attached.

    Example:
        >>> def train(lr):
        ...     from nbaccel import Accelerator
        ...     return Accelerator().num_processes
        >>> notebook_launcher(train, (0.1,), num_processes=2)
        2
    """
    port = _port_number(use_port)
    base_ip = config.main_process_ip if config is not None else None
    endpoint_host = rdzv_endpoint.rsplit(":", 1)[0] if rdzv_endpoint else None
    cfg = _resolve(config, main_process_ip=base_ip or endpoint_host or master_addr, num_processes=num_processes,
                   mixed_precision=mixed_precision, use_cpu=use_cpu,
                   machine_rank=node_rank, num_machines=num_nodes, main_process_port=port,
                   start_method=start_method, timeout=timeout)
    if hang_timeout is not None and hang_timeout <= 0:
        raise ConfigError(f"hang_timeout must be a positive number of seconds or None (got {hang_timeout!r})",
                          key="hang_timeout", value=hang_timeout, valid="> 0 or None")
    if cfg.num_machines > 1:
        from nbaccel.launch.elastic import launch_multi_node

        _check_single_machine_options(output_ranks=output_ranks, timeout=cfg.timeout, observer=observer)

        return launch_multi_node(
            function, args, dict(kwargs or {}), cfg, master_addr=master_addr, rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf or {}, rdzv_id=rdzv_id, max_restarts=max_restarts,
            monitor_interval=monitor_interval, log_line_prefix_template=log_line_prefix_template,
            return_all=return_all)
    plan = plan_launch(cfg)
    say(plan.note)
    if plan.device_kind == "xla":
        from nbaccel.launch.xla import launch_xla

        return launch_xla(function, args, dict(kwargs or {}), plan, output_ranks=output_ranks,
                          return_all=return_all, timeout=cfg.timeout, observer=observer, hang_timeout=hang_timeout)
    shown = _check_ranks(output_ranks, plan.num_processes)
    results = run_local(function, args, dict(kwargs or {}), plan, port=cfg.main_process_port or 0,
                        shown=shown, timeout=cfg.timeout, hang_timeout=hang_timeout, observer=observer)
    return results if return_all else results.get(0)


def run_local(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], plan: LaunchPlan,
              *, port: int = 0, shown: frozenset[int] | None = None, timeout: float | None = None,
              hang_timeout: float | None = 120.0, observer: LaunchObserver | None = None) -> dict[int, Any]:
    """Run ``plan`` on this machine's workers and return ``{rank: result}``."""
    n = plan.num_processes
    payload = None
    if plan.start_method == "spawn":  # fail on an unpicklable payload before anything starts
        from nbaccel.launch.payload import dumps_payload

        payload = dumps_payload(function, args, kwargs)
    else:
        _warm_imports()
    store = LoopbackStore(port=port) if n > 1 else None
    files = SpawnFiles() if plan.start_method == "spawn" else None
    relay = OutputRelay(show=shown, on_line=observer.on_output if observer is not None else None)
    try:
        envs = []
        for rank in range(n):
            dist = DistributedEnv(rank=rank, local_rank=rank, world_size=n, local_world_size=n, node_rank=0,
                                  master_addr="127.0.0.1", master_port=store.port if store else 0) if n > 1 else None
            envs.append(worker_environment(plan.settings, dist, agent_store=store is not None, loopback_only=True,
                                           threads=plan.threads, visible_gpus=plan.visible_gpus))
        if observer is not None:
            observer.on_launch(list(range(n)), plan.start_method)
        ok = False
        try:  # the observer hears the end even when starting fails or is interrupted
            if files is not None:
                handles = start_spawned(function, args, kwargs, envs, files, payload=payload)
            else:
                handles = start_forked(function, args, kwargs, envs,
                                       inherited_fds=[store.listen_fd] if store is not None else [])
            results = Supervisor(handles, relay, observer, timeout=timeout, hang_timeout=hang_timeout).run()
            ok = True
        finally:
            if observer is not None:
                observer.on_end(ok)
        return results
    finally:
        if store is not None:
            store.close()
        if files is not None:
            files.remove()


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> Any:
    """Run ``function`` on ``num_processes`` CPU workers, to debug distributed code anywhere.

    Example:
        >>> debug_launcher(lambda: 1, num_processes=2)
        1
    """
    return notebook_launcher(function, args, num_processes=num_processes, use_cpu=True)
