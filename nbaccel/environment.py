"""The one module that writes the environment: nbaccel's variables and torchrun's, for workers.

Workers learn everything from their environment: the torchrun variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and nbaccel's own settings, exported here from a :class:`WorkerSettings`
and read back as one typed object by :func:`read_worker_settings`.

A launch is its own job wherever it starts (inside a pool rank, a launched function, a kernel run
by torchrun): an outer job's variables never reach its workers (:func:`child_base_environment`,
:func:`apply_worker_environment`), so its ranks meet only each other, on their own port.

What hardware is here (and whether forking is safe) is :mod:`nbaccel.hardware`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from nbaccel.distributed_type import (
    LAUNCHABLE_TYPES,
    DistributedType,
    as_distributed_type,
)
from nbaccel.errors import ConfigError

__all__ = [
    "ASSUME_UNSAFE_FORK",
    "FORCE_TPU",
    "DistributedEnv",
    "MixedPrecision",
    "WorkerSettings",
    "apply_environment",
    "apply_worker_environment",
    "child_base_environment",
    "clear_environment",
    "config_file_path",
    "env_flag",
    "patch_environment",
    "read_distributed_env",
    "read_worker_settings",
    "replace_environment",
    "settings_from_fields",
    "single_process_environment",
    "temporary_environment",
    "without_outer_job",
    "worker_environment",
]

MixedPrecision = Literal["no", "fp16", "bf16", "fp8"]

_PREFIX = "NBACCEL_"
_LAUNCHED = "NBACCEL_LAUNCHED"
_CONFIG_FILE = "NBACCEL_CONFIG_FILE"
FORCE_TPU = "NBACCEL_TPU"
"""``1``/``0`` overrides TPU detection (:func:`nbaccel.hardware.tpu_detected`)."""
ASSUME_UNSAFE_FORK = "NBACCEL_ASSUME_UNSAFE_FORK"
"""``1`` makes launches spawn as if fork were unsafe (:func:`nbaccel.hardware.fork_unsafe_reason`)."""
_TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
# what torchrun sets for a rank: in a process that launches, they describe the outer job, never the inner one
_OUTER_JOB_KEYS = frozenset((*_TORCHRUN_KEYS, "GROUP_RANK", "GROUP_WORLD_SIZE",
                               "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE"))


@dataclass(frozen=True)
class WorkerSettings:
    """nbaccel's settings as one worker sees them.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        use_cpu: train on CPU even where accelerators exist.
        distributed_type: the kind of job (``"MULTI_CPU"``, ``"MULTI_GPU"``, ``"XLA"``, ...).
        num_machines: how many machines take part.
        fsdp_config: Accelerate-style ``fsdp_config`` mapping (empty when unused).
        deepspeed_config: Accelerate-style ``deepspeed_config`` mapping (empty when unused).
        debug: extra checks of collective shapes.
        launched: ``True`` inside workers started by nbaccel.

    Raises:
        ConfigError: ``distributed_type`` names no kind of job.
    """

    mixed_precision: MixedPrecision = "no"
    use_cpu: bool = False
    distributed_type: DistributedType = DistributedType.NO
    num_machines: int = 1
    fsdp_config: Mapping[str, object] = field(default_factory=dict)
    deepspeed_config: Mapping[str, object] = field(default_factory=dict)
    debug: bool = False
    launched: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "distributed_type", as_distributed_type(self.distributed_type))


@dataclass(frozen=True)
class DistributedEnv:
    """The torchrun variables of one worker."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


def worker_environment(settings: WorkerSettings, dist: DistributedEnv | None = None,
                       *, agent_store: bool = False, loopback_only: bool = False,
                       threads: int | None = None, visible_gpus: str | None = None) -> dict[str, str]:
    """The environment variables that carry ``settings`` (and ``dist``) to a worker.

    Args:
        settings: nbaccel's settings for the worker.
        dist: the worker's torchrun variables, if it is part of a process group.
        agent_store: the launcher hosts the rendezvous store, so every rank connects as a
            client (torch's ``TORCHELASTIC_USE_AGENT_STORE`` protocol).
        loopback_only: a single-machine job: gloo and NCCL talk over ``lo`` only (unless the
            user chose an interface already).
        threads: ``OMP_NUM_THREADS`` for the worker, unless the user set it.
        visible_gpus: ``CUDA_VISIBLE_DEVICES`` for the worker (``None``: leave it).

    Returns:
        A ``{name: value}`` mapping; :func:`read_worker_settings` reads it back.

    Example:
        >>> env = worker_environment(WorkerSettings(mixed_precision="bf16"))
        >>> read_worker_settings(env).mixed_precision
        'bf16'
    """
    env = {
        _LAUNCHED: "1" if settings.launched else "0",
        f"{_PREFIX}MIXED_PRECISION": settings.mixed_precision,
        "ACCELERATE_MIXED_PRECISION": settings.mixed_precision,  # what Accelerate's own code in a worker reads
        f"{_PREFIX}USE_CPU": "1" if settings.use_cpu else "0",
        "ACCELERATE_USE_CPU": "true" if settings.use_cpu else "false",  # Accelerate's MULTI_CPU needs it
        f"{_PREFIX}DISTRIBUTED_TYPE": str(settings.distributed_type),
        f"{_PREFIX}NUM_MACHINES": str(settings.num_machines),
        f"{_PREFIX}FSDP_CONFIG": json.dumps(dict(settings.fsdp_config)),
        f"{_PREFIX}DEEPSPEED_CONFIG": json.dumps(dict(settings.deepspeed_config)),
        f"{_PREFIX}DEBUG": "1" if settings.debug else "0",
    }
    if dist is not None:
        env.update(_torchrun_variables(dist))
        if agent_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            env["TORCHELASTIC_RESTART_COUNT"] = "0"
    if loopback_only:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = "lo"
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus
    if not settings.use_cpu and settings.distributed_type in ("MULTI_GPU", "FSDP", "DEEPSPEED"):
        from nbaccel.cuda_probe import (
            nccl_p2p_workaround,  # RTX 40xx on old drivers: NCCL hangs on P2P
        )

        env.update({k: v for k, v in nccl_p2p_workaround().items() if k not in os.environ})
    return env


def env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "0").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no", ""):
        return False
    raise ConfigError(f"environment variable {name} must be 0 or 1 (got {raw!r})",
                      key=name, value=raw, valid=("0", "1"))


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, default)
    if raw not in choices:
        raise ConfigError(f"environment variable {name} must be one of {list(choices)} (got {raw!r})",
                          key=name, value=raw, valid=choices)
    return raw


def _json(env: Mapping[str, str], name: str) -> dict:
    raw = env.get(name, "") or "{}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"environment variable {name} must hold a JSON object (got {raw!r}: {exc})",
                          key=name, value=raw, valid="a JSON object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"environment variable {name} must hold a JSON object (got {raw!r})",
                          key=name, value=raw, valid="a JSON object")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an int (got {raw!r})",
                          key=name, value=raw, valid="an int") from None


def read_worker_settings(env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Read nbaccel's settings back from ``env`` (default: ``os.environ``).

    Also honours Accelerate's ``ACCELERATE_MIXED_PRECISION`` and ``ACCELERATE_USE_CPU`` when
    nbaccel's own variables are absent, so scripts started by ``accelerate launch`` keep their
    settings.

    Raises:
        ConfigError: a variable holds an invalid value.
    """
    env = os.environ if env is None else env
    mp_default = env.get("ACCELERATE_MIXED_PRECISION", "no")
    cpu_name = f"{_PREFIX}USE_CPU" if f"{_PREFIX}USE_CPU" in env else "ACCELERATE_USE_CPU"
    return WorkerSettings(
        mixed_precision=_choice(env, f"{_PREFIX}MIXED_PRECISION", mp_default,  # type: ignore[arg-type]  # _choice returns one of the Literal's values, as str
                                get_args(MixedPrecision)),
        use_cpu=env_flag(env, cpu_name),
        distributed_type=_choice(env, f"{_PREFIX}DISTRIBUTED_TYPE", "NO",  # type: ignore[arg-type]  # _choice returns one of the Literal's values, as str
                                 tuple(t.value for t in LAUNCHABLE_TYPES)),
        num_machines=_int(env, f"{_PREFIX}NUM_MACHINES", 1),
        fsdp_config=_json(env, f"{_PREFIX}FSDP_CONFIG"),
        deepspeed_config=_json(env, f"{_PREFIX}DEEPSPEED_CONFIG"),
        debug=env_flag(env, f"{_PREFIX}DEBUG") or env_flag(env, "ACCELERATE_DEBUG_MODE"),
        launched=env_flag(env, _LAUNCHED),
    )


def read_distributed_env(env: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The torchrun variables of this process, or ``None`` when ``WORLD_SIZE``/``RANK`` are unset."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = _int(env, "WORLD_SIZE", 1)
    return DistributedEnv(
        rank=_int(env, "RANK", 0), local_rank=_int(env, "LOCAL_RANK", 0), world_size=world,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world), node_rank=_int(env, "NODE_RANK", 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
    )


def _torchrun_variables(dist: DistributedEnv) -> dict[str, str]:
    return {"RANK": str(dist.rank), "LOCAL_RANK": str(dist.local_rank),
            "WORLD_SIZE": str(dist.world_size), "LOCAL_WORLD_SIZE": str(dist.local_world_size),
            "NODE_RANK": str(dist.node_rank), "GROUP_RANK": str(dist.node_rank),
            "MASTER_ADDR": dist.master_addr, "MASTER_PORT": str(dist.master_port)}


def single_process_environment() -> dict[str, str]:
    """torchrun's variables for a world of one on a free loopback port (nothing is set here).

    For code that needs a process group outside a launch: a script run by ``nbaccel launch``
    without workers, DeepSpeed in a notebook. :func:`read_distributed_env` reads them back.

    Example:
        >>> env = single_process_environment()
        >>> read_distributed_env(env).world_size, env["MASTER_ADDR"]
        (1, '127.0.0.1')
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return _torchrun_variables(DistributedEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                                              master_addr="127.0.0.1", master_port=port))


def apply_environment(values: Mapping[str, str]) -> None:
    """Set ``values`` in this process's environment (inside freshly started workers, and for a library that
    reads its switches from there, such as mlflow's file store)."""
    os.environ.update(values)


def replace_environment(values: Mapping[str, str]) -> None:
    """Make this process's environment exactly ``values`` (a warm rank taking its caller's, as a fork would)."""
    for name in [n for n in os.environ if n not in values]:
        del os.environ[name]
    os.environ.update(values)


@contextmanager
def temporary_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration of the block, then restore."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def patch_environment(**kwargs: object) -> Iterator[None]:
    """Accelerate's ``patch_environment``: set ``KEY=str(value)`` (keys upper-cased) for the block, then restore.

    Example:
        >>> with patch_environment(nbaccel_example=1):
        ...     os.environ["NBACCEL_EXAMPLE"]
        '1'
    """
    with temporary_environment({key.upper(): str(value) for key, value in kwargs.items()}):
        yield


@contextmanager
def clear_environment() -> Iterator[None]:
    """Accelerate's ``clear_environment``: run the block with an empty ``os.environ``, then restore it whole.

    Example:
        >>> with clear_environment():
        ...     len(os.environ)
        0
    """
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _outer_job_variable(name: str) -> bool:
    return name in _OUTER_JOB_KEYS or name.startswith("TORCHELASTIC_")


def child_base_environment() -> dict[str, str]:
    """A copy of this process's environment without any torchrun or nbaccel worker variables."""
    return {k: v for k, v in os.environ.items() if not _outer_job_variable(k)
            and not (k.startswith(_PREFIX) and k not in (_CONFIG_FILE, ASSUME_UNSAFE_FORK, FORCE_TPU))}


def without_outer_job(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less an outer job's rank variables (torchrun's, torch elastic's), the rest as it is.

    Example:
        >>> without_outer_job({"RANK": "1", "MASTER_PORT": "29500", "HOME": "/root"})
        {'HOME': '/root'}
    """
    return {k: v for k, v in environ.items() if not _outer_job_variable(k)}


def apply_worker_environment(values: Mapping[str, str]) -> None:
    """Give a freshly forked worker ``values`` and nothing of an outer job's: a launcher that is itself a rank
    passes its ``RANK``, ``MASTER_PORT``, ... down a fork, and they would make the worker join the outer job."""
    for name in [n for n in os.environ if _outer_job_variable(n) and n not in values]:
        del os.environ[name]
    os.environ.update(values)


def config_file_path() -> Path:
    """Where the config file lives: ``$NBACCEL_CONFIG_FILE``, else the cache directory."""
    explicit = os.environ.get(_CONFIG_FILE)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "nbaccel" / "default_config.yaml"


def settings_from_fields(**fields: object) -> WorkerSettings:
    """Build :class:`WorkerSettings` from the fields it knows, ignoring the rest."""
    names = {f.name for f in dataclasses.fields(WorkerSettings)}
    return WorkerSettings(**{k: v for k, v in fields.items() if k in names})  # type: ignore[arg-type]  # the callers pass WorkerSettings' own fields
