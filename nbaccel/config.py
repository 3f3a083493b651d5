"""`LaunchConfig`: the launch settings, their validation, and the YAML/JSON config file.

One file holds the settings the ``%accel_config`` panel and ``nbaccel config`` write. Its keys
mean what they mean in Accelerate's ``default_config.yaml``, so an Accelerate config file loads
as it is. Values are layered: file < session (the panel's "Use for this session") < flags <
explicit arguments; :meth:`LaunchConfig.with_overrides` applies one layer.
"""

from __future__ import annotations

import dataclasses
import functools
import enum
import json
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from nbaccel.config_text import parse_config_text, read_config_file
from nbaccel.distributed_type import (
    LAUNCHABLE_TYPES,
    DistributedType,
    as_distributed_type,
)
from nbaccel.environment import MixedPrecision, config_file_path
from nbaccel.errors import ConfigError

__all__ = ["LaunchBackend", "LaunchConfig", "PlacementStrategy", "StartMethod", "changed_fields", "load_config",
           "save_config"]

StartMethod = Literal["fork", "spawn"]
RdzvBackend = Literal["static", "c10d"]
LaunchBackend = Literal["local", "ray"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

# Keys an Accelerate config file can hold that nbaccel reads but does not act on: every field of
# Accelerate 1.16's ClusterConfig and SageMakerConfig (commands/config/config_args.py) that is
# not a LaunchConfig field, plus keys older Accelerate versions wrote (``fp16``, ``dynamo_backend``,
# ``tp_config``, ``tpu_metadata``, ...). They are kept, so a file written by Accelerate survives
# a load and save unchanged, and listed by ``LaunchConfig.unused_keys``.
_ACCELERATE_PASSTHROUGH = frozenset({
    # ClusterConfig
    "compute_environment", "enable_cpu_affinity", "fp8_config", "parallelism_config", "megatron_lm_config",
    "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file",
    "commands", "tpu_vm", "tpu_env", "dynamo_config",
    # SageMakerConfig
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name", "pytorch_version",
    "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
    # written by older Accelerate versions
    "fp16", "dynamo_backend", "tp_config", "tpu_metadata", "tpu_virtual_env", "ipex_config",
    "num_cpu_threads_per_process", "use_mps_device",
})
# nbaccel's own keys, which Accelerate does not know: written to a file only when not the default.
_NBACCEL_ONLY = frozenset({"backend", "ray_address", "ray_placement_strategy"})
# Accelerate's distributed types that nbaccel has no engine for.
_UNSUPPORTED_TYPES = ("MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                      "MULTI_HPU", "MEGATRON_LM")


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs to know, validated on construction.

    Args:
        distributed_type: the kind of job; ``None`` picks one from the hardware found.
        num_processes: workers per machine (Accelerate counts all machines: see ``from_mapping``);
            ``None`` uses the devices found.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        use_cpu: run on CPU even where GPUs exist.
        gpu_ids: ``"all"`` or a comma-separated list such as ``"0,1"``: numbers count the GPUs this
            process sees (with ``CUDA_VISIBLE_DEVICES=2,3``, ``"1"`` is physical GPU 3); UUIDs
            (``GPU-...``, ``MIG-...``) name a GPU directly.
        num_machines: machines taking part.
        machine_rank: this machine's index, ``0 <= machine_rank < num_machines``.
        main_process_ip: address of machine 0 (needed when ``num_machines > 1``).
        main_process_port: port of machine 0's rendezvous; ``None`` picks a free one.
        rdzv_backend: ``"static"`` or ``"c10d"``.
        same_network: machines share a network (Accelerate's key; informational here).
        main_training_function: the function ``nbaccel launch`` calls in a script, if any.
        start_method: ``"fork"``, ``"spawn"`` or ``None`` (fork when safe).
        timeout: seconds before a launch is stopped; ``None`` for no limit.
        debug: extra checks of collective shapes in the workers.
        fsdp_config: Accelerate's ``fsdp_config`` mapping.
        deepspeed_config: Accelerate's ``deepspeed_config`` mapping.
        backend: where the workers run: ``"local"`` (this machine, or torch elastic across
            ``num_machines``) or ``"ray"`` (Ray actors on a Ray cluster; nbaccel's own key).
        ray_address: the Ray cluster to use with ``backend="ray"``: ``None`` uses the connection
            this process already has (``ray.init``) or else what ``ray.init()`` does (``RAY_ADDRESS``,
            or a new local instance); ``"auto"`` or ``"ray://host:10001"`` connect as Ray does.
        ray_placement_strategy: how Ray places the ranks' bundles: ``"PACK"`` (as few nodes as
            fit, the default), ``"SPREAD"``, ``"STRICT_PACK"`` or ``"STRICT_SPREAD"``.
        extra: Accelerate keys nbaccel keeps but does not act on.

    Example:
        >>> cfg = LaunchConfig(num_processes=2, mixed_precision="bf16")
        >>> cfg.with_overrides(num_processes=4).num_processes
        4
    """

    distributed_type: DistributedType | None = None
    num_processes: int | None = None
    mixed_precision: MixedPrecision = "no"
    use_cpu: bool = False
    gpu_ids: str = "all"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: RdzvBackend = "static"
    same_network: bool = True
    main_training_function: str = "main"
    start_method: StartMethod | None = None
    timeout: float | None = None
    debug: bool = False
    fsdp_config: Mapping[str, Any] = field(default_factory=dict)
    deepspeed_config: Mapping[str, Any] = field(default_factory=dict)
    backend: LaunchBackend = "local"
    ray_address: str | None = None
    ray_placement_strategy: PlacementStrategy = "PACK"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hints = _field_types()
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.distributed_type is not None:
            object.__setattr__(self, "distributed_type", as_distributed_type(self.distributed_type))
        _check_combinations(self)

    # ----------------------------------------------------------------- layering
    def with_overrides(self, **overrides: Any) -> LaunchConfig:
        """A copy with every override that is not ``None`` applied (one precedence layer).

        Raises:
            ConfigError: an override names an unknown field or has an invalid value.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r}; valid keys: {sorted(names)}",
                              key=unknown[0], value=overrides[unknown[0]], valid=sorted(names))
        given = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    @property
    def unused_keys(self) -> list[str]:
        """The Accelerate keys this config holds that nbaccel keeps but does not act on, sorted.

        Example:
            >>> LaunchConfig.from_mapping({"tpu_vm": [], "num_processes": 2}).unused_keys
            ['tpu_vm']
        """
        return sorted(self.extra)

    # ----------------------------------------------------------------- mappings
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config") -> LaunchConfig:
        """Build a config from file-style keys (nbaccel's or Accelerate's).

        Accelerate's ``num_processes`` counts workers on *all* machines; it is divided by
        ``num_machines`` here, since nbaccel counts workers per machine.

        Raises:
            ConfigError: an unknown key, a wrong type, or an impossible combination.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source} must hold a mapping of keys to values (got {type(data).__name__})",
                              key=None, value=data, valid="a YAML/JSON mapping")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {}
        nested = data.get("extra") or {}
        if not isinstance(nested, Mapping):
            raise ConfigError(f"{source}: 'extra' must be a mapping of Accelerate keys to values (got {nested!r} of "
                              f"type {type(nested).__name__}). Fix: remove the 'extra' line, or write the keys at "
                              "the top level", key="extra", value=nested, valid="a mapping")
        extra: dict[str, Any] = dict(nested)
        for key, value in data.items():
            if key == "extra":
                continue
            if key in names:
                values[key] = value
            elif key in _ACCELERATE_PASSTHROUGH:
                extra[key] = value
            else:
                valid = sorted(names | _ACCELERATE_PASSTHROUGH)
                raise ConfigError(f"{source}: unknown key {key!r}; valid keys: {valid}",
                                  key=key, value=value, valid=valid)
        dtype = values.get("distributed_type")
        if dtype == "TPU":  # Accelerate's older name
            values["distributed_type"] = "XLA"
        elif dtype in _UNSUPPORTED_TYPES:
            raise ConfigError(
                f"{source}: distributed_type {dtype!r} has no engine in nbaccel; valid values: "
                f"{[t.value for t in LAUNCHABLE_TYPES]}. Fix: set distributed_type to one of those.",
                key="distributed_type", value=dtype, valid=tuple(t.value for t in LAUNCHABLE_TYPES))
        gpu_ids = values.get("gpu_ids")
        if isinstance(gpu_ids, int):
            values["gpu_ids"] = str(gpu_ids)
        machines = values.get("num_machines", 1)
        procs = values.get("num_processes")
        if isinstance(machines, int) and machines > 1 and isinstance(procs, int) and procs % machines == 0:
            values["num_processes"] = procs // machines
        if isinstance(values.get("timeout"), int) and not isinstance(values.get("timeout"), bool):
            values["timeout"] = float(values["timeout"])
        try:
            return cls(**values, extra=extra)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}", key=exc.key, value=exc.value, valid=exc.valid) from None

    def to_mapping(self) -> dict[str, Any]:
        """File-style keys, Accelerate-compatible (``num_processes`` counts all machines)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (f.name in _NBACCEL_ONLY and value == f.default):
                continue  # nbaccel's own keys only when set: Accelerate's loader rejects keys it does not know
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, enum.Enum):  # plain strings in files
                value = value.value
            out[f.name] = value
        if self.num_processes is not None:
            out["num_processes"] = self.num_processes * self.num_machines
        out.update(dict(self.extra))
        return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _field_types() -> dict[str, Any]:
    """``LaunchConfig``'s resolved annotations (resolving them costs 0.4 ms: once per process, not per config)."""
    return typing.get_type_hints(LaunchConfig)


def _check_type(name: str, value: Any, tp: Any) -> None:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return
        non_none = [o for o in options if o is not type(None)]
        if len(non_none) == 1:
            return _check_type(name, value, non_none[0])
        for option in non_none:
            try:
                _check_type(name, value, option)
                return
            except ConfigError:
                continue
        raise ConfigError(f"{name!r} must be one of {[_type_name(o) for o in options]} (got {value!r})",
                          key=name, value=value, valid=options)
    if origin is Literal or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        choices = get_args(tp) if origin is Literal else tuple(m.value for m in tp)
        if tp is DistributedType:  # it names other hardware too; a launch takes only what nbaccel runs
            choices = tuple(m.value for m in LAUNCHABLE_TYPES)
        if value not in choices:
            raise ConfigError(f"{name!r} must be one of {list(choices)} (got {value!r}). "
                              f"Fix: set {name} to one of those.", key=name, value=value, valid=choices)
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name!r} must be true or false (got {value!r} of type {type(value).__name__})",
                              key=name, value=value, valid=(True, False))
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name!r} must be an int (got {value!r} of type {type(value).__name__})",
                              key=name, value=value, valid="an int")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name!r} must be a number (got {value!r} of type {type(value).__name__})",
                              key=name, value=value, valid="a number")
        return
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name!r} must be a string (got {value!r} of type {type(value).__name__})",
                              key=name, value=value, valid="a string")
        return
    if (origin in (Mapping, dict) or tp is Mapping) and not isinstance(value, Mapping):
        raise ConfigError(f"{name!r} must be a mapping (got {value!r} of type {type(value).__name__})",
                          key=name, value=value, valid="a mapping")


def _check_combinations(cfg: LaunchConfig) -> None:
    def bad(key: str, msg: str, valid: object) -> ConfigError:
        return ConfigError(msg, key=key, value=getattr(cfg, key), valid=valid)

    if cfg.num_processes is not None and cfg.num_processes < 1:
        raise bad("num_processes", f"'num_processes' must be a positive int (got {cfg.num_processes}). "
                  "Fix: pass num_processes=2, or None to use the devices found.", "an int >= 1")
    if cfg.num_machines < 1:
        raise bad("num_machines", f"'num_machines' must be a positive int (got {cfg.num_machines})", "an int >= 1")
    if not 0 <= cfg.machine_rank < cfg.num_machines:
        raise bad("machine_rank", f"'machine_rank' must be in [0, {cfg.num_machines - 1}] for "
                  f"num_machines={cfg.num_machines} (got {cfg.machine_rank})", f"0..{cfg.num_machines - 1}")
    if cfg.main_process_port is not None and not 0 < cfg.main_process_port < 65536:
        raise bad("main_process_port", f"'main_process_port' must be in 1..65535 (got {cfg.main_process_port})",
                  "1..65535")
    if cfg.timeout is not None and cfg.timeout <= 0:
        raise bad("timeout", f"'timeout' must be a positive number of seconds (got {cfg.timeout})", "> 0")
    if cfg.num_machines > 1 and not cfg.main_process_ip:
        raise bad("main_process_ip", f"'main_process_ip' is required when num_machines={cfg.num_machines}. "
                  "Fix: set main_process_ip to machine 0's address.", "an address")
    if cfg.use_cpu and cfg.distributed_type in ("MULTI_GPU", "XLA", "DEEPSPEED"):
        raise bad("distributed_type", f"use_cpu=True conflicts with distributed_type='{cfg.distributed_type}'. "
                  "Fix: drop use_cpu, or set distributed_type to 'MULTI_CPU'.", ("NO", "MULTI_CPU", "FSDP"))
    if cfg.backend == "ray" and cfg.num_machines > 1:
        raise bad("num_machines", f"backend='ray' places ranks on the cluster's nodes itself, so num_machines must "
                  f"stay 1 (got {cfg.num_machines}). Fix: drop num_machines (num_processes counts every rank on "
                  "the cluster), or use backend='local' for torch elastic.", 1)
    if cfg.backend == "ray" and cfg.distributed_type in ("XLA", "DEEPSPEED"):
        raise bad("distributed_type", f"backend='ray' runs CPU or GPU ranks, not distributed_type="
                  f"'{cfg.distributed_type}'. Fix: use backend='local' for it.",
                  ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP"))
    if cfg.gpu_ids != "all":
        parts = [p.strip() for p in cfg.gpu_ids.split(",")]
        if not all(p.isdigit() or re.fullmatch(r"(GPU|MIG)-[\w\-/]+", p) for p in parts):
            raise bad("gpu_ids", f"'gpu_ids' must be 'all' or comma-separated GPU numbers or UUIDs like '0,1' or "
                      f"'GPU-8f3c...' (got {cfg.gpu_ids!r})", "'all', '0,1,...' or 'GPU-...,...'")


def changed_fields(config: LaunchConfig, base: LaunchConfig) -> dict[str, Any]:
    """The fields of ``config`` whose values differ from ``base``'s, as ``{name: value}``.

    Example:
        >>> changed_fields(LaunchConfig(num_processes=3), LaunchConfig())
        {'num_processes': 3}
    """
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(base, f.name)}


def load_config(path: str | os.PathLike[str] | None = None, *, missing_ok: bool = True) -> LaunchConfig:
    """Read the config file (YAML, or JSON when it ends in ``.json``).

    Args:
        path: the file; default :func:`nbaccel.environment.config_file_path`.
        missing_ok: return the defaults when the file does not exist.

    Raises:
        ConfigError: the file is missing (and ``missing_ok`` is false), unreadable, not a regular file,
            invalid, or past a limit of :mod:`nbaccel.config_text` (size, YAML aliases, nesting).

    Example:
        >>> cfg = load_config()  # defaults if no file was written yet
    """
    file = Path(path) if path is not None else config_file_path()
    if not file.exists():
        if missing_ok and path is None:
            return LaunchConfig()
        raise ConfigError(f"config file {str(file)!r} does not exist. Fix: write one with "
                          "`nbaccel config`, or pass an existing path.", key="config_file",
                          value=str(file), valid="an existing file")
    text = read_config_file(file)
    data = parse_config_text(text, source=str(file), as_json=file.suffix == ".json")
    return LaunchConfig.from_mapping(data or {}, source=str(file))


def save_config(config: LaunchConfig, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``config`` atomically (YAML, or JSON for ``.json``); returns the path written."""
    file = Path(path) if path is not None else config_file_path()
    file.parent.mkdir(parents=True, exist_ok=True)
    data = config.to_mapping()
    text = json.dumps(data, indent=2) if file.suffix == ".json" else yaml.safe_dump(data, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, file)
    except BaseException:
        os.unlink(tmp)
        raise
    return file
