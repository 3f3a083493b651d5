"""FSDP2: shard a model with ``fully_shard``, point its optimizer at the sharded parameters, save full state dicts.

``fully_shard`` replaces a module's parameters with sharded ``DTensor`` parameters, so an
optimizer built before ``prepare`` would update stale tensors; :func:`shard_model` maps each old
parameter to its replacement by name and rewrites the optimizers' parameter groups. Full
state dicts are gathered with ``torch.distributed.checkpoint.state_dict`` (a collective: every
rank calls it; with ``cpu_offload`` only rank 0 receives the tensors).

Mixed precision is FSDP2's own: a ``MixedPrecisionPolicy`` (from the plugin, or built from the
accelerator's ``mixed_precision`` as Accelerate builds it) gathers parameters in ``param_dtype``
for forward and backward and reduces gradients in ``reduce_dtype``, while the sharded parameters
the optimizer updates, and the full state dicts, stay float32.
"""

from __future__ import annotations

from typing import Any

import torch

from nbaccel.errors import ConfigError
from nbaccel.training.fsdp_policy import make_mixed_precision_policy
from nbaccel.training.plugins import FullyShardedDataParallelPlugin

__all__ = ["full_model_state_dict", "full_optimizer_state_dict", "is_fsdp_model", "load_full_model_state_dict",
           "load_full_optimizer_state_dict", "shard_model"]

def is_fsdp_model(model: Any) -> bool:
    """Whether ``model`` has been sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _upcast_trainable(model: torch.nn.Module) -> None:
    """Make trainable parameters float32, shard by shard:
    FSDP2 needs one dtype per group, and the policy casts for compute.

    Run after ``fully_shard``, so each rank converts only its own shard (never the full model).
    ``FSDPModule._apply`` re-registers the converted shards, as it does for ``model.to(dtype)``; only
    trainable parameters change (frozen weights and buffers keep their dtype).
    """
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad and tensor.is_floating_point() and tensor.dtype != torch.float32:
            return tensor.float()
        return tensor

    model._apply(cast)


def _wrap_targets(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[torch.nn.Module]:
    if plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        plugin.set_auto_wrap_policy(model)  # raises when no class name matches
        names = set(plugin.transformer_cls_names_to_wrap or ())
        return [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if plugin.auto_wrap_policy == "SIZE_BASED_WRAP":
        limit = plugin.min_num_params or 100_000_000
        return [m for m in model.modules() if m is not model and type(m).forward is not torch.nn.Module.forward
                and any(True for _ in m.children()) and sum(p.numel() for p in m.parameters()) >= limit]
    return []


def shard_model(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, device: torch.device,
                num_processes: int, optimizers: list[torch.optim.Optimizer], upcast: bool = False) -> torch.nn.Module:
    """Apply ``fully_shard`` to the wrap targets then the root, over a 1-D mesh of all processes.

    The model is sharded where it is (CPU, or the meta device): ``fully_shard`` moves each group to
    the mesh's device as it shards it, so an accelerator holds at most one group in full, never the
    whole model (as in Accelerate, which does not place FSDP models first). Ranks whose model is
    on the meta device get their shards from rank 0's weights (see
    :mod:`nbaccel.training.fsdp_materialize`). Upcasting happens after, on each rank's shard.

    Args:
        model: the model, anywhere (CPU, ``device``, or ``meta`` on some or all ranks).
        plugin: the FSDP settings; its ``mixed_precision_policy`` (``None``: full precision) is used.
        device: this process's device (its type names the mesh's device type).
        num_processes: size of the mesh.
        optimizers: optimizers built on ``model``'s parameters; they are re-pointed in place.
        upcast: make trainable half-precision parameters float32 (mixed precision keeps
            float32 master weights, as in Accelerate).

    Returns:
        ``model`` itself, now an ``FSDPModule``.

    Raises:
        ConfigError: ``cpu_offload`` on a group without a CPU backend; or the model is on the
            meta device on every rank and cannot be initialized.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from nbaccel.training.fsdp_materialize import plan_materialization

    if plugin.cpu_offload and device.type == "cuda":
        _check_group_carries_cpu()
    before = dict(model.named_parameters())
    targets = _wrap_targets(model, plugin)
    mesh = init_device_mesh(device.type, (num_processes,))
    filling = plan_materialization(model, device, bool(plugin.cpu_offload),
                                   from_rank0=_truthy(plugin.cpu_ram_efficient_loading))
    kwargs: dict[str, Any] = {
        "mesh": mesh, "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": make_mixed_precision_policy(plugin.mixed_precision_policy) or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if plugin.cpu_offload else OffloadPolicy(),
    }
    for module in targets:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    filling.apply(model)
    if upcast:
        _upcast_trainable(model)
    after = dict(model.named_parameters())
    mapping = {id(before[name]): after[name] for name in before if name in after}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    return model


def _truthy(value: Any) -> bool:
    """A plugin flag that may come from a config file as a string."""
    return str(value).lower() in ("true", "1") if isinstance(value, str) else bool(value)


def _check_group_carries_cpu() -> None:
    """CPU-offloaded shards are reduced on CPU (``clip_grad_norm_``):
    plain NCCL cannot carry them (torch issue 148532)."""
    import torch.distributed as dist

    from nbaccel.ops import group_device_types
    from nbaccel.process_state import CUDA_WITH_CPU_BACKEND

    if "cpu" in group_device_types():
        return
    backend = dist.get_backend_config()
    raise ConfigError(f"FSDP cpu_offload=True needs a process group that also carries CPU tensors, but this one is "
                      f"{backend!r}: clip_grad_norm_ would all-reduce CPU shards on NCCL and fail. Fix: make the "
                      "Accelerator (with its fsdp_plugin) before any other ProcessState/PartialState, or pass "
                      f"kwargs_handlers=[InitProcessGroupKwargs(backend={CUDA_WITH_CPU_BACKEND!r})]",
                      key="backend", value=backend, valid=CUDA_WITH_CPU_BACKEND)


def _options(full: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def _gathered(state: dict[str, Any], ranks: tuple[int, ...]) -> dict[str, Any]:
    """A sharded state dict gathered tensor by tensor onto CPU, kept only on ``ranks`` (others get an empty dict).

    What ``full_state_dict=True, cpu_offload=True`` does for rank 0 alone, for several ranks (each
    node's writer under ``save_on_each_node``): one full tensor at a time on the accelerator.
    """
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _gather_state_dict

    gathered = _gather_state_dict(state, cpu_offload=True, ranks_only=ranks, type_check=False)
    return gathered if dist.get_rank() in ranks else {}


def full_model_state_dict(model: torch.nn.Module, ranks: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """The gathered model state dict, on CPU on ``ranks`` (others get an empty dict). Call on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if tuple(ranks) == (0,):
        return get_model_state_dict(model, options=_options())
    return _gathered(get_model_state_dict(model, options=_options(full=False)), tuple(ranks))


def _from_rank0() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def load_full_model_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Load a full state dict that only rank 0 read (the others pass ``{}``) into a sharded model. Call on every rank.

    Rank 0 broadcasts tensor by tensor and each rank keeps its shard, so the host holds one copy
    of the weights, not one per rank.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict, options=_from_rank0())


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              ranks: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """The gathered optimizer state dict, keyed by parameter names, on ``ranks``. Call on every rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if tuple(ranks) == (0,):
        return get_optimizer_state_dict(model, optimizer, options=_options())
    return _gathered(get_optimizer_state_dict(model, optimizer, options=_options(full=False)), tuple(ranks))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Load a gathered optimizer state dict that only rank 0 read (others pass ``{}``). Call on every rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # Whether there is any state, and the hyperparameters, are rank 0's to tell (a few bytes).
    told: list[Any] = [{"stateless": not state_dict.get("state"),
             "groups": [{k: v for k, v in g.items() if k != "params"} for g in state_dict.get("param_groups", [])]}
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(told, src=0)
    if told[0]["stateless"]:
        # A stateless optimizer (plain SGD): torch cannot place an empty state; only hyperparameters remain.
        for group, saved in zip(optimizer.param_groups, told[0]["groups"]):
            group.update(saved)
        return
    set_optimizer_state_dict(model, optimizer, state_dict, options=_from_rank0())


def sharded_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, folder: Any) -> None:
    """Write each rank's shards with ``torch.distributed.checkpoint`` (``SHARDED_STATE_DICT``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder))


def sharded_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, folder: Any) -> None:
    """Read shards written by :func:`sharded_save` back into ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
