"""`LaunchRequest`: one launch, resolved and validated once, carrying every setting a launcher needs.

The magic, the CLI and :func:`~nbaccel.launch.launcher.notebook_launcher` each build one with
:func:`build_request`; no launcher reads a setting from anywhere else. Precedence, lowest first:
the config file < the session's defaults (``%accel_config``) < flags < explicit arguments; the
callers layer the first three into a :class:`LaunchConfig`, and :func:`build_request` applies the
explicit arguments, plans the launch and chooses the launcher, in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, get_args

from nbaccel.config import LaunchConfig, RdzvBackend
from nbaccel.errors import ConfigError
from nbaccel.launch.base import LaunchRequest, Rendezvous
from nbaccel.launch.events import LaunchObserver
from nbaccel.launch.preflight import plan_launch, wants_xla
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.registry import backend_for

__all__ = ["LaunchRequest", "Rendezvous", "build_request"]

_DEFAULT_ADDR = "127.0.0.1"


def _port_number(use_port: int | str | None) -> int | None:
    if use_port in (None, ""):
        return None
    try:
        return int(use_port)
    except (TypeError, ValueError):
        raise ConfigError(f"use_port must be a port number from 1 to 65535, or None for a free one (got "
                          f"{use_port!r}). Fix: pass use_port=None, or a number such as 29500.", key="use_port",
                          value=use_port, valid="1..65535 or None") from None


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


def _refuse_on_several_machines(**given: Any) -> None:
    """Refuse options that only nbaccel's own supervisor honours, before a multi-machine launch."""
    used = [name for name, value in given.items() if value is not None]
    if used:
        raise ConfigError(f"{used[0]} is not supported for multi-machine launches (num_nodes > 1): those run "
                          "under torch's elastic agent, which streams every rank's output and has no timeout or "
                          f"status events. Fix: drop {used[0]}, or launch on one machine.", key=used[0],
                          value=given[used[0]], valid=None)


def _rendezvous(cfg: LaunchConfig, *, backend: str | None, endpoint: str, conf: Mapping[str, Any] | None,
                run_id: str, max_restarts: int, monitor_interval: float, prefix: str | None) -> Rendezvous:
    chosen = backend if backend is not None else cfg.rdzv_backend
    if chosen not in get_args(RdzvBackend):
        raise ConfigError(f"rdzv_backend must be one of {list(get_args(RdzvBackend))} (got {chosen!r}). Fix: pass "
                          "rdzv_backend='c10d' (or 'static' with node_rank=).", key="rdzv_backend", value=chosen,
                          valid=get_args(RdzvBackend))
    if not endpoint and cfg.main_process_port:
        endpoint = f"{cfg.main_process_ip}:{cfg.main_process_port}"
    if not endpoint:
        raise ConfigError("a multi-machine launch needs a rendezvous endpoint. Fix: pass "
                          "rdzv_endpoint='host:port' (or use_port= with master_addr=).",
                          key="rdzv_endpoint", value=endpoint, valid="'host:port'")
    settings = dict(conf or {})
    if chosen == "static":
        settings.setdefault("rank", cfg.machine_rank)
    return Rendezvous(backend=chosen, endpoint=endpoint, conf=settings, run_id=run_id,  # type: ignore[arg-type]  # chosen checked against RdzvBackend above
                      max_restarts=max_restarts, monitor_interval=monitor_interval,
                      log_line_prefix_template=prefix)


def build_request(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    config: LaunchConfig | None = None,
    launcher: str | None = None,
    hang_timeout: float | None = 120.0,
    output_ranks: Iterable[int] | int | None = None,
    return_all: bool = False,
    observer: LaunchObserver | None = None,
    warm_imports: bool | None = None,
    lifecycle: RankLifecycle | None = None,
    fresh: bool = False,
    master_addr: str | None = None,
    use_port: int | str | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    **settings: Any,
) -> LaunchRequest:
    """Resolve and validate one launch: ``config`` with the explicit arguments on top, planned here.

    Args:
        function: what every worker runs.
        args: its positional arguments.
        kwargs: its keyword arguments.
        config: the settings layered so far (file < session < flags); ``None``: the defaults.
        launcher: a launcher module's name, to choose one explicitly; ``None`` picks ``"ray"`` for
            ``backend="ray"``, ``"elastic"`` for several machines, ``"xla"`` on XLA devices,
            ``"warm"`` for one process on this machine (the rank kept warm, unless ``fresh``), else ``"local"``.
        hang_timeout: see :class:`LaunchRequest`.
        output_ranks: see :class:`LaunchRequest`.
        return_all: see :class:`LaunchRequest`.
        observer: see :class:`LaunchRequest`.
        warm_imports: see :class:`LaunchRequest`.
        lifecycle: see :class:`LaunchRequest`; ``None``: nbaccel's :class:`~nbaccel.rank_lifecycle.RankLifecycle`.
        fresh: a one-process launch starts a new process instead of using the warm rank.
        master_addr: machine 0's address; wins over the config's ``main_process_ip``.
        use_port: the rendezvous port; wins over the config's ``main_process_port``.
        rdzv_backend: wins over the config's ``rdzv_backend`` (multi-machine).
        rdzv_endpoint: ``host:port`` of the rendezvous (multi-machine).
        rdzv_conf: extra rendezvous settings (multi-machine).
        rdzv_id: the job id shared by all machines (multi-machine).
        max_restarts: restarts the elastic agent may make (multi-machine).
        monitor_interval: seconds between the elastic agent's checks (multi-machine).
        log_line_prefix_template: the elastic agent's output prefix (multi-machine).
        **settings: :class:`LaunchConfig` fields; those not ``None`` win over ``config``.

    Raises:
        ConfigError: a setting is invalid, or asks for hardware that is not here; nothing started.
        EnvironmentStateError: fork was requested but is unsafe in this process.

    Example:
        >>> request = build_request(print, ("hi",), num_processes=2, use_cpu=True)
        >>> request.launcher, request.num_processes, request.plan.start_method
        ('local', 2, 'fork')
    """
    base = config if config is not None else LaunchConfig()
    if hang_timeout is not None and hang_timeout <= 0:
        raise ConfigError(f"hang_timeout must be a positive number of seconds or None (got {hang_timeout!r})",
                          key="hang_timeout", value=hang_timeout, valid="> 0 or None")
    endpoint_host = rdzv_endpoint.rsplit(":", 1)[0] if rdzv_endpoint else None
    address = master_addr or base.main_process_ip or endpoint_host or _DEFAULT_ADDR
    cfg = base.with_overrides(main_process_ip=address, main_process_port=_port_number(use_port), **settings)
    rendezvous = None
    if cfg.num_machines > 1:
        _refuse_on_several_machines(output_ranks=output_ranks, timeout=cfg.timeout, observer=observer)
        rendezvous = _rendezvous(cfg, backend=rdzv_backend, endpoint=rdzv_endpoint, conf=rdzv_conf,
                                 run_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
                                 prefix=log_line_prefix_template)
    # Ray's cluster, or the XLA runtime, not this machine's preflight, says what the ranks run on.
    place = "ray" if cfg.backend == "ray" else "xla" if wants_xla(cfg) else None
    plan = backend_for(place).plan(cfg) if place is not None else plan_launch(cfg)
    if place == "ray":
        launcher = launcher or "ray"
    if launcher is None:
        launcher = "elastic" if rendezvous is not None else "xla" if plan.device_kind == "xla" else "local"
        if launcher == "local" and plan.num_processes == 1 and not fresh:
            launcher = "warm"  # a repeated one-process launch: milliseconds on a kept rank, not a new process
    return LaunchRequest(
        function=function, args=tuple(args), kwargs=dict(kwargs or {}), config=cfg, plan=plan,
        launcher=launcher, hang_timeout=hang_timeout, output_ranks=_check_ranks(output_ranks, plan.num_processes),
        return_all=return_all, observer=observer, rendezvous=rendezvous, warm_imports=warm_imports,
        lifecycle=lifecycle if lifecycle is not None else RankLifecycle())
