"""`notebook_launcher` and `debug_launcher`: run a function on N worker processes from anywhere.

The signature is Accelerate's, so existing notebooks run unchanged; nbaccel adds keywords (start
method, timeout and hang watchdog, output ranks, every rank's result, an observer) and differs on
purpose: the function's return value comes back, the settings really reach the workers, a free
port is picked, CPU-only machines form one gloo job, and an unsafe fork becomes a spawn. It is a
thin adapter: its arguments become one :class:`~nbaccel.launch.request.LaunchRequest`, which
:func:`~nbaccel.launch.registry.launch` hands to the launcher that runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nbaccel.config import LaunchBackend, LaunchConfig, StartMethod
from nbaccel.environment import MixedPrecision
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.registry import launch
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.request import build_request
from nbaccel.launch.restarts import run_with_restarts

__all__ = ["debug_launcher", "notebook_launcher"]


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    use_port: int | str | None = None,
    master_addr: str | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    rdzv_backend: str | None = None,
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
    lifecycle: RankLifecycle | None = None,
    backend: LaunchBackend | None = None,
    ray_address: str | None = None,
    fresh: bool = False,
    background: bool = False,
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
        master_addr: machine 0's address for multi-node runs (single-machine runs use loopback);
            wins over the config's ``main_process_ip``. ``None``: the config's, else ``127.0.0.1``.
        node_rank: this machine's rank in a multi-node run.
        num_nodes: machines taking part; more than one goes through torch's elastic agent.
        rdzv_backend: ``"static"`` or ``"c10d"`` (multi-node); ``None``: the config's (default ``"static"``).
        rdzv_endpoint: ``host:port`` of the rendezvous (multi-node).
        rdzv_conf: extra rendezvous settings (multi-node).
        rdzv_id: the job id shared by all machines (multi-node).
        max_restarts: how often a launch whose worker failed is run again (on several machines,
            the elastic agent's restarts).
        monitor_interval: seconds between the elastic agent's checks (multi-node).
        log_line_prefix_template: the elastic agent's output prefix (multi-node).
        kwargs: keyword arguments for ``function``.
        start_method: ``"fork"``, ``"spawn"`` or ``None`` (fork when safe).
        timeout: stop the launch after this many seconds (raises ``LaunchTimeoutError``).
        hang_timeout: when some ranks have finished and the rest print nothing for this many
            seconds, dump their stacks and stop them; ``None`` disables the watchdog. Single-machine
            launches only: a multi-machine launch runs under torch's elastic agent, which ignores
            this and refuses ``timeout``, ``output_ranks`` and ``observer``.
        output_ranks: show only these ranks' output (results and errors still come back), and
            publish these ranks' displays (``display()``, figures), labelled when several;
            ``None``: every rank's output, rank 0's displays.
        return_all: return ``{rank: value}`` instead of rank 0's value.
        use_cpu: run on CPU processes even where GPUs exist.
        config: a :class:`LaunchConfig` supplying every value not given here.
        observer: receives per-rank state and output events (the status panel).
        lifecycle: what each rank does before the function (nbaccel's extension, not Accelerate's): a
            :class:`~nbaccel.rank_lifecycle.RankLifecycle` subclass forgets state of your own too.
        backend: ``"local"`` (this machine; torch elastic across ``num_nodes``) or ``"ray"``: the
            ranks run as Ray actors on a Ray cluster, ``num_processes`` of them across its nodes
            (a GPU each unless ``use_cpu``), with the same output, results, failures and interrupt
            as a local launch. ``None``: the config's (default ``"local"``). nbaccel's own option.
        ray_address: with ``backend="ray"``, the cluster: ``None`` uses this process's connection
            (``ray.init`` done already) or else starts a local instance; ``"auto"`` or
            ``"ray://host:10001"`` connect as Ray does.
        fresh: with one process, start a new worker process for this launch. By default a
            one-process launch on this machine runs on a rank nbaccel keeps warm for this
            kernel (milliseconds instead of a new process and CUDA context each time), as a
            fresh run: the caller's environment, RNG state and working directory, nbaccel's state
            reset, GPU memory released after; see :mod:`nbaccel.launch.pool.warm` for what stays.
            nbaccel's own option: Accelerate runs one process in the notebook itself.
        background: return at once with a :class:`~nbaccel.runs.handle.LaunchRun` while the ranks run
            (the kernel stays free): ``run.result()`` is what this call would return (or raise),
            ``run.cancel()`` stops it as Ctrl-C would, ``run.show()`` shows it live. The run holds
            its GPUs (or the warm rank) until it ends. nbaccel's own option; one machine only.

    Returns:
        Rank 0's return value (moved to CPU), or ``{rank: value}`` when ``return_all``; with
        ``background=True``, the run's handle.

    Raises:
        ConfigError: an argument is invalid; nothing was started.
        MissingDependencyError: ``backend="ray"`` without Ray installed.
        EnvironmentStateError: ``start_method="fork"`` but fork is unsafe here.
        PayloadPicklingError: under spawn, the function or an argument cannot be pickled.
        LaunchTimeoutError: ``timeout`` passed or the watchdog fired.
        KeyboardInterrupt: the caller was interrupted; every worker was stopped.
        WorkerFailedError: a worker failed, on this machine or another: the root-cause worker's own
            exception type joined with ``WorkerFailedError``, every rank's failure on ``failures``.
        RunBusyError: a background run holds the GPUs (or the warm rank) this launch needs.

    Example:
        >>> def train(lr):
        ...     from nbaccel import Accelerator
        ...     return Accelerator().num_processes
        >>> notebook_launcher(train, (0.1,), num_processes=2)
        2
    """
    request = build_request(
        function, args, kwargs, config=config, hang_timeout=hang_timeout, output_ranks=output_ranks,
        return_all=return_all, observer=observer, lifecycle=lifecycle, master_addr=master_addr, use_port=use_port,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id,
        max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template, num_processes=num_processes,
        mixed_precision=mixed_precision, use_cpu=use_cpu, machine_rank=node_rank, num_machines=num_nodes,
        start_method=start_method, timeout=timeout, backend=backend, ray_address=ray_address, fresh=fresh)
    if background:
        from nbaccel.runs.start import cell_label, launch_in_background

        return launch_in_background(request, lambda req: run_with_restarts(lambda: launch(req), max_restarts),
                                    cell=cell_label(getattr(function, "__name__", "notebook_launcher")))
    if request.rendezvous is not None:  # several machines: the elastic agent restarts
        return launch(request)
    return run_with_restarts(lambda: launch(request), max_restarts)


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> Any:
    """Run ``function`` on ``num_processes`` CPU workers, to debug distributed code anywhere.

    Example:
        >>> debug_launcher(lambda: 1, num_processes=2)
        1
    """
    return notebook_launcher(function, args, num_processes=num_processes, use_cpu=True)
