"""Accelerate's configuration objects: dataloader, accumulation, project, FSDP and DeepSpeed plugins.

The ``*Kwargs`` handlers (arguments passed through to torch) are :mod:`nbaccel.training.kwargs_handlers`.

Each is a small validated dataclass with Accelerate's name and field names, so code written for
Accelerate constructs them unchanged. Invalid values raise :class:`~nbaccel.errors.ConfigError`
naming the field, the value and what is valid.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from nbaccel.errors import ConfigError
from nbaccel.training.fsdp1_options import FSDP1_OPTIONS, translate_fsdp1_options

__all__ = [
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
]

StateDictType = Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"]
AutoWrapPolicy = Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"`{name}` must be a positive int (got {value!r} of type {type(value).__name__}); "
                          f"pass for example {name}=1", key=name, value=value, valid="an int >= 1")


def _check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` must be one of {list(choices)} (got {value!r})", key=name,
                          value=value, valid=choices)


@dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders split and move batches.

    Args:
        split_batches: each batch from the loader is split across processes (the batch size
            is then the global batch size); otherwise batch ``i`` goes to rank ``i % n``.
        even_batches: pad the last round by cycling from the start so every rank gets the
            same number of full batches (``gather_for_metrics`` drops the padding again).
        dispatch_batches: rank 0 reads every batch and sends each rank its slice (default:
            ``True`` for iterable datasets, ``False`` otherwise).
        non_blocking: copy batches to the device with ``non_blocking=True`` (pair it with
            ``pin_memory=True`` on CUDA).
        use_seedable_sampler: shuffle with a sampler seeded by ``seed + epoch``, so a run is
            reproducible from its seed alone.
        data_seed: the seed of that sampler (default: drawn from torch's RNG on rank 0).

    Example:
        >>> DataLoaderConfiguration(even_batches=False).even_batches
        False
    """

    split_batches: bool = False
    even_batches: bool = True
    dispatch_batches: bool | None = None
    non_blocking: bool = False
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.use_stateful_dataloader:
            raise ConfigError("`use_stateful_dataloader=True` needs torchdata's StatefulDataLoader, which "
                              "nbaccel does not support; resume with `skip_first_batches` instead",
                              key="use_stateful_dataloader", value=True, valid=(False,))


@dataclass
class GradientAccumulationPlugin:
    """How gradient accumulation counts steps.

    Args:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: count skipped scheduler steps so the schedule follows optimizer steps.
        sync_with_dataloader: always sync (and step) on the last batch of the dataloader.
        sync_each_batch: synchronize gradients on every micro-batch (saves memory, costs speed).

    Example:
        >>> GradientAccumulationPlugin(num_steps=4).num_steps
        4
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        _check_positive_int("num_steps", self.num_steps)


@dataclass
class ProjectConfiguration:
    """Where checkpoints go, and how many are kept.

    Args:
        project_dir: root folder of the run.
        logging_dir: folder for logs (default: ``project_dir``).
        automatic_checkpoint_naming: ``save_state()`` without a folder writes
            ``project_dir/checkpoints/checkpoint_<iteration>``.
        total_limit: how many automatic checkpoints to keep (oldest removed first).
        iteration: the number of the next automatic checkpoint.
        save_on_each_node: write on every machine's local main process (no shared filesystem).

    Example:
        >>> ProjectConfiguration("runs/a", automatic_checkpoint_naming=True).logging_dir
        'runs/a'
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None:
            _check_positive_int("total_limit", self.total_limit)

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when it followed it)."""
        follow = self.logging_dir == self.project_dir
        self.project_dir = project_dir
        if follow:
            self.logging_dir = project_dir


@dataclass
class FullyShardedDataParallelPlugin:
    """Shard the model with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Args:
        fsdp_version: only ``2`` (FSDP2); legacy FSDP is not used.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3 style).
        auto_wrap_policy: which submodules get their own shard group.
        transformer_cls_names_to_wrap: class names wrapped with ``TRANSFORMER_BASED_WRAP``.
        min_num_params: parameter threshold for ``SIZE_BASED_WRAP``.
        state_dict_type: how ``save_state`` writes the model: gathered on rank 0
            (``FULL_STATE_DICT``) or one shard per rank (``SHARDED_STATE_DICT``).
        cpu_offload: keep sharded parameters on CPU.
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a precision
            name (``"bf16"``, ``"fp16"``, ``"fp32"``: parameter and reduction dtype), or a dict of
            the policy's fields. ``None``: built from the accelerator's ``mixed_precision``.
        cpu_ram_efficient_loading: every rank takes rank 0's weights, broadcast into its shards
            after sharding (as in Accelerate); the other ranks may build the model on the meta
            device. Ranks whose model is on the meta device get rank 0's weights in any case.

    Example:
        >>> FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]).auto_wrap_policy
        'TRANSFORMER_BASED_WRAP'
    """

    fsdp_version: int = 2
    reshard_after_forward: bool = True
    auto_wrap_policy: AutoWrapPolicy | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None
    state_dict_type: StateDictType = "FULL_STATE_DICT"
    cpu_offload: bool = False
    mixed_precision_policy: Any = None
    # FSDP1-style options (nbaccel.training.fsdp1_options maps, warns about or refuses each)
    sharding_strategy: Any = None
    backward_prefetch: Any = None
    forward_prefetch: Any = None
    use_orig_params: Any = None
    sync_module_states: Any = None
    limit_all_gathers: Any = None
    ignored_modules: Any = None
    param_init_fn: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    cpu_ram_efficient_loading: Any = None
    activation_checkpointing: Any = None
    activation_checkpointing_offload: Any = None

    def __post_init__(self) -> None:
        self.__dict__.update(translate_fsdp1_options({k: getattr(self, k) for k in FSDP1_OPTIONS}))
        if self.fsdp_version != 2:
            raise ConfigError(f"`fsdp_version` must be 2 (got {self.fsdp_version!r}): nbaccel shards with FSDP2 "
                              "(`fully_shard`); set fsdp_version=2", key="fsdp_version",
                              value=self.fsdp_version, valid=(2,))
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [s.strip() for s in self.transformer_cls_names_to_wrap.split(",")]
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = ("TRANSFORMER_BASED_WRAP" if self.transformer_cls_names_to_wrap
                                     else "SIZE_BASED_WRAP" if self.min_num_params else "NO_WRAP")
        _check_choice("auto_wrap_policy", self.auto_wrap_policy, get_args(AutoWrapPolicy))
        _check_choice("state_dict_type", self.state_dict_type, get_args(StateDictType))
        if self.mixed_precision_policy is not None:
            from nbaccel.training.fsdp_policy import make_mixed_precision_policy

            self.mixed_precision_policy = make_mixed_precision_policy(self.mixed_precision_policy)

    def set_auto_wrap_policy(self, model: Any) -> None:
        """Check the wrap policy against ``model``, as Accelerate's does before sharding.

        With ``TRANSFORMER_BASED_WRAP`` and no class names, the model's ``_no_split_modules``
        (a Transformers convention) that it really contains are used.

        Raises:
            ConfigError: no class name matches a submodule of ``model``.
        """
        if self.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
            return
        found = {type(m).__name__ for m in model.modules()}
        if not self.transformer_cls_names_to_wrap:
            self.transformer_cls_names_to_wrap = [n for n in getattr(model, "_no_split_modules", None) or ()
                                                  if n in found]
        names = set(self.transformer_cls_names_to_wrap)
        if not names & found:
            raise ConfigError(f"transformer_cls_names_to_wrap={sorted(names)} matches no submodule of "
                              f"{type(model).__name__}; its module classes are {sorted(found)}",
                              key="transformer_cls_names_to_wrap", value=sorted(names), valid=sorted(found))

    def set_mixed_precision(self, mixed_precision: str, override: bool = False) -> None:
        """Shard with ``mixed_precision`` (``"bf16"``, ``"fp16"``): parameters gathered and gradients reduced in it.

        A policy the plugin already has is kept unless ``override``, as in Accelerate.

        Raises:
            ConfigError: an unknown precision name.

        Example:
            >>> plugin = FullyShardedDataParallelPlugin(); plugin.set_mixed_precision("bf16")
            >>> plugin.mixed_precision_policy.reduce_dtype
            torch.bfloat16
        """
        if override or self.mixed_precision_policy is None:
            from nbaccel.training.fsdp_policy import make_mixed_precision_policy

            self.mixed_precision_policy = make_mixed_precision_policy(mixed_precision)

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> FullyShardedDataParallelPlugin:
        """Build the plugin from Accelerate's ``fsdp_config`` keys (``fsdp_version``, ...).

        Raises:
            ConfigError: a key is unknown or a value invalid.
        """
        names = {"fsdp_version": "fsdp_version", "fsdp_reshard_after_forward": "reshard_after_forward",
                 "fsdp_auto_wrap_policy": "auto_wrap_policy",
                 "fsdp_transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
                 "fsdp_min_num_params": "min_num_params", "fsdp_state_dict_type": "state_dict_type",
                 "fsdp_offload_params": "cpu_offload"}
        names |= {f"fsdp_{option}": option for option in FSDP1_OPTIONS}
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            if key not in names:
                raise ConfigError(f"unknown fsdp_config key {key!r}; valid keys: {sorted(names)}", key=key,
                                  value=value, valid=sorted(names))
            kwargs[names[key]] = value
        if isinstance(kwargs.get("reshard_after_forward"), str):  # FSDP1's FULL_SHARD / SHARD_GRAD_OP
            kwargs["reshard_after_forward"] = kwargs["reshard_after_forward"].upper() in ("FULL_SHARD", "TRUE")
        return cls(**kwargs)


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings: a ``hf_ds_config`` (dict or JSON path) or Accelerate's short fields.

    Accepted everywhere; used only where the ``deepspeed`` package is installed. Elsewhere
    :class:`~nbaccel.Accelerator` raises :class:`~nbaccel.errors.MissingDependencyError`.

    Example:
        >>> DeepSpeedPlugin(zero_stage=2).deepspeed_config["zero_optimization"]["stage"]
        2
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    deepspeed_config: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        config: dict[str, Any]
        if self.hf_ds_config is None:
            config = {}
        elif isinstance(self.hf_ds_config, Mapping):
            config = json.loads(json.dumps(dict(self.hf_ds_config)))
        elif isinstance(self.hf_ds_config, (str, Path)) and Path(self.hf_ds_config).is_file():
            config = json.loads(Path(self.hf_ds_config).read_text())
        else:
            raise ConfigError(f"`hf_ds_config` must be a dict or the path of a JSON file (got "
                              f"{self.hf_ds_config!r} of type {type(self.hf_ds_config).__name__})",
                              key="hf_ds_config", value=self.hf_ds_config, valid="a dict or an existing .json path")
        if self.zero_stage is not None:
            _check_choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
            config.setdefault("zero_optimization", {})["stage"] = self.zero_stage
        if self.gradient_accumulation_steps is not None:
            config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = self.gradient_clipping
        for key, device in (("offload_optimizer", self.offload_optimizer_device),
                            ("offload_param", self.offload_param_device)):
            if device not in (None, "none"):
                config.setdefault("zero_optimization", {})[key] = {"device": device}
        self.deepspeed_config = config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DeepSpeedPlugin:  # Any: values as the YAML file gives them
        """Build the plugin from Accelerate's ``deepspeed_config`` keys
        (``zero_stage``, ``deepspeed_config_file``, ...)."""
        return cls(hf_ds_config=config.get("deepspeed_config_file"),
                   gradient_accumulation_steps=config.get("gradient_accumulation_steps"),
                   gradient_clipping=config.get("gradient_clipping"),
                   zero_stage=config.get("zero_stage"),
                   offload_optimizer_device=config.get("offload_optimizer_device"),
                   offload_param_device=config.get("offload_param_device"))
