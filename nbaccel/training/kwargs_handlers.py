"""Accelerate's kwargs handlers: arguments the Accelerator passes through to torch's own objects.

``DistributedDataParallelKwargs`` (DDP, its communication hook), ``GradScalerKwargs``,
``AutocastKwargs`` and ``InitProcessGroupKwargs``, with Accelerate's names and fields, given to
``Accelerator(kwargs_handlers=[...])``; :meth:`KwargsHandler.to_kwargs` gives only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from nbaccel.training.ddp_comm_hooks import (
    DDPCommunicationHookType,
    as_comm_hook_type,
    register_comm_hook,
)

__all__ = ["AutocastKwargs", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
           "KwargsHandler"]


class KwargsHandler:
    """Base of the ``*Kwargs`` handlers: :meth:`to_kwargs` gives only the fields changed from their default."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose values differ from the defaults, as a dict."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]  # self is a dataclass
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments passed to ``torch.nn.parallel.DistributedDataParallel``.

    Example:
        >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
        {'find_unused_parameters': True}
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = as_comm_hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = as_comm_hook_type(self.comm_wrapper, "comm_wrapper")

    def to_kwargs(self) -> dict[str, Any]:
        """The changed DDP constructor arguments (the ``comm_*`` fields go to :meth:`register_comm_hook`)."""
        return {k: v for k, v in super().to_kwargs().items() if not k.startswith("comm_")}

    def register_comm_hook(self, model: Any) -> None:
        """Register ``comm_hook`` (wrapped by ``comm_wrapper``) on the DDP ``model``, as Accelerate does."""
        register_comm_hook(model, self.comm_hook, self.comm_wrapper, self.comm_state_option)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments passed to ``torch.amp.GradScaler`` for ``mixed_precision="fp16"``.

    Example:
        >>> GradScalerKwargs(init_scale=1024.0).to_kwargs()
        {'init_scale': 1024.0}
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` inside :meth:`Accelerator.autocast`.

    Example:
        >>> AutocastKwargs(enabled=False).to_kwargs()
        {'enabled': False}
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group`` (backend and timeout).

    Example:
        >>> from datetime import timedelta
        >>> InitProcessGroupKwargs(timeout=timedelta(seconds=60)).timeout.seconds
        60
    """

    backend: str | None = None
    timeout: timedelta | None = None
