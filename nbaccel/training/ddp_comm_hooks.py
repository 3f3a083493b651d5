"""DDP communication hooks: compress or approximate gradients before DDP all-reduces them.

Accelerate's ``DDPCommunicationHookType`` and the registration its
``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)`` does,
over the hooks PyTorch ships (``torch.distributed.algorithms.ddp_comm_hooks``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nbaccel.errors import ConfigError

__all__ = ["DDPCommunicationHookType", "as_comm_hook_type", "register_comm_hook"]


class DDPCommunicationHookType(str, enum.Enum):
    """A DDP communication hook: Accelerate's ``DDPCommunicationHookType``, as a ``str`` enum.

    ``FP16`` / ``BF16`` send gradients in half precision; ``POWER_SGD`` / ``BATCHED_POWER_SGD``
    send low-rank approximations. As ``comm_wrapper``, ``FP16`` / ``BF16`` compress what another
    hook sends.

    Example:
        >>> DDPCommunicationHookType("fp16") is DDPCommunicationHookType.FP16
        True
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


def as_comm_hook_type(value: object, key: str) -> DDPCommunicationHookType:
    """``value`` (a member or its value) as a :class:`DDPCommunicationHookType`.

    Raises:
        ConfigError: ``value`` names no hook.
    """
    try:
        return DDPCommunicationHookType(value)
    except ValueError:
        valid = tuple(t.value for t in DDPCommunicationHookType)
        raise ConfigError(f"`{key}` must be one of {list(valid)} (got {value!r}). Fix: pass e.g. "
                          f"{key}=DDPCommunicationHookType.FP16.", key=key, value=value, valid=valid) from None


# A DDP communication hook: (its state: a process group or PowerSGDState, the bucket) -> the reduced bucket.
_Hook = Callable[[Any, "torch.distributed.GradBucket"], "torch.futures.Future[torch.Tensor]"]


def register_comm_hook(model: torch.nn.parallel.DistributedDataParallel, comm_hook: DDPCommunicationHookType,
                       comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO,
                       comm_state_option: Mapping[str, Any] | None = None) -> None:
    """Register ``comm_hook`` (wrapped by ``comm_wrapper``) on a DDP model; ``NO`` registers nothing.

    Args:
        model: the DDP-wrapped model.
        comm_hook: the hook.
        comm_wrapper: ``FP16`` / ``BF16`` to compress what the hook sends, or ``NO``.
        comm_state_option: keyword arguments of ``PowerSGDState`` (PowerSGD hooks only).

    Raises:
        ConfigError: ``comm_wrapper`` is a PowerSGD type (only FP16 / BF16 wrap).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    comm_hook = as_comm_hook_type(comm_hook, "comm_hook")
    comm_wrapper = as_comm_hook_type(comm_wrapper, "comm_wrapper")
    wrappers: dict[DDPCommunicationHookType, Callable[[_Hook], _Hook]] = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
    if comm_wrapper is not DDPCommunicationHookType.NO and comm_wrapper not in wrappers:
        raise ConfigError(f"`comm_wrapper` must be one of ['no', 'fp16', 'bf16'] (got {comm_wrapper.value!r}). "
                          "Fix: use PowerSGD as `comm_hook` and fp16/bf16 as its wrapper.",
                          key="comm_wrapper", value=comm_wrapper.value, valid=("no", "fp16", "bf16"))
    if comm_hook is DDPCommunicationHookType.NO:
        return
    hooks: dict[DDPCommunicationHookType, _Hook] = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
    hook = hooks[comm_hook]
    if comm_wrapper in wrappers:
        hook = wrappers[comm_wrapper](hook)
    power_sgd = comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
    state = powerSGD_hook.PowerSGDState(None, **dict(comm_state_option or {})) if power_sgd else None
    model.register_comm_hook(state=state, hook=hook)
