"""Give an FSDP2 model that some ranks built on the ``meta`` device real shards, after ``fully_shard``.

What always holds: the model is sharded while it is still empty, so no rank ever holds a full copy
on its accelerator, and after :meth:`Materialization.apply` no parameter or buffer is on ``meta``.
Where the weights come from (decided once, the same on every rank, by :func:`plan_materialization`):

- ``"broadcast"``: rank 0 has real weights (and some rank has none, or the plugin asks for
  ``cpu_ram_efficient_loading``). As Accelerate's ``cpu_ram_efficient_loading`` does, every rank
  moves its model to ``meta`` before sharding, then rank 0's full state dict is broadcast into the
  shards (``set_model_state_dict(..., broadcast_from_rank0=True)``), so only rank 0 ever held the
  weights in host memory. Buffers outside the state dict (``persistent=False``) are broadcast too.
- ``"reset"``: rank 0 has no weights either (the model was built on ``meta`` everywhere): the
  shards are allocated (``to_empty``) and every module's ``reset_parameters()`` initializes them,
  torch's recipe for FSDP2 deferred initialization. Accelerate has no answer for this case.
- ``"none"``: every rank has real weights; nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from nbaccel.errors import ConfigError

__all__ = ["Materialization", "plan_materialization"]

Source = Literal["none", "broadcast", "reset"]


def _has_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@dataclass
class Materialization:
    """How this rank's sharded model gets its values (see the module docstring).

    Attributes:
        source: where the values come from.
        device: where the shards live (the accelerator, or CPU with ``cpu_offload``).
        state_dict: rank 0's full state dict (``"broadcast"``; empty on the other ranks).
        buffers: rank 0's buffers that are not in the state dict (``"broadcast"``).
    """

    source: Source
    device: torch.device
    state_dict: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def apply(self, model: torch.nn.Module) -> None:
        """Fill the sharded ``model`` (call on every rank, after ``fully_shard``; a collective for ``"broadcast"``)."""
        if self.source == "none":
            return
        model.to_empty(device=self.device)
        if self.source == "reset":
            _reset(model)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, self.state_dict, options=StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
        self.state_dict.clear()  # rank 0's host copy goes as soon as the shards hold it
        _broadcast_buffers(model, self.buffers, self.device)
        tie_weights = getattr(model, "tie_weights", None)
        if callable(tie_weights):  # as Accelerate does for transformers models
            tie_weights()


def plan_materialization(model: torch.nn.Module, device: torch.device, cpu_offload: bool,
                         from_rank0: bool = False) -> Materialization:
    """Decide where ``model``'s values come from and, for ``"broadcast"``, empty it
    (call on every rank, before sharding).

    A collective: every rank tells whether its model has ``meta`` tensors.

    Args:
        model: the model, not sharded yet.
        device: this rank's device (its accelerator; the flags travel on it).
        cpu_offload: the shards will live on CPU.
        from_rank0: take rank 0's weights even where every rank has its own
            (the plugin's ``cpu_ram_efficient_loading``).

    Raises:
        ConfigError: no rank has weights and some module that owns tensors has no ``reset_parameters``.
    """
    import torch.distributed as dist

    rank0 = _rank() == 0
    mine = _has_meta(model)
    flags = torch.tensor([int(mine), int(mine and rank0)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_meta, rank0_meta = bool(flags[0]), bool(flags[1])
    home = torch.device("cpu") if cpu_offload else device
    if rank0_meta:
        _check_resettable(model)
        return Materialization("reset", home)
    if not (any_meta or from_rank0):
        return Materialization("none", home)
    plan = Materialization("broadcast", home)
    if rank0:
        plan.state_dict = model.state_dict()  # references: the tensors outlive the move to meta below
        kept = set(plan.state_dict)
        plan.buffers = {name: b for name, b in model.named_buffers() if name not in kept}
    model.to(torch.device("meta"))  # sharded empty on every rank; rank 0's values stay in plan.state_dict
    return plan


def _owners(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that directly own a parameter or buffer."""
    return [(name, m) for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))]


def _check_resettable(model: torch.nn.Module) -> None:
    missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in _owners(model)
               if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ConfigError(
            f"the model is on the meta device on every rank, rank 0 included, so FSDP can only initialize it by "
            f"calling each module's reset_parameters(), but these modules own tensors and have none: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Fix: build the model with real weights "
            "on rank 0 (the other ranks may use the meta device; rank 0's weights are then broadcast into the "
            "shards, as Accelerate's cpu_ram_efficient_loading does), or give those modules a reset_parameters()",
            key="model", value=missing, valid="modules with reset_parameters(), or real weights on rank 0")


def _reset(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for _, module in _owners(model):
            cast(Any, module).reset_parameters()  # each has one: plan_materialization checked (_check_resettable)


def _broadcast_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Rank 0's non-persistent buffers into every rank's model (they are not in any state dict)."""
    import torch.distributed as dist

    names = sorted(name for name, _ in model.named_buffers() if name not in model.state_dict())
    for name in names:
        local = dict(model.named_buffers())[name]
        value = buffers[name].to(device) if _rank() == 0 else torch.empty_like(local, device=device)
        dist.broadcast(value, src=0)
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_buffer(leaf, value, persistent=False)
