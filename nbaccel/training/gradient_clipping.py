"""Accelerator methods for gradients before the optimizer step: unscaling fp16 gradients and clipping them.

``clip_grad_norm_`` and ``clip_grad_value_`` unscale fp16 gradients first and, on XLA, all-reduce
them first (the optimizer step then skips its own reduce); under DeepSpeed the engine clips.
As in Accelerate; mixed into :class:`~nbaccel.Accelerator`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nbaccel.training.gradient_state import GradientState
from nbaccel.training.optimizer import AcceleratedOptimizer
from nbaccel.training.prepared import PreparedObjects

__all__ = ["GradientClipping"]


class GradientClipping:
    """``unscale_gradients``, ``clip_grad_norm_`` and ``clip_grad_value_`` for an object with
    ``prepared``, ``deepspeed_engine``, ``device``, ``num_processes`` and ``gradient_state`` (the Accelerator)."""

    prepared: PreparedObjects
    deepspeed_engine: Any
    gradient_state: GradientState

    if TYPE_CHECKING:  # read-only properties of the Accelerator; declared here for the type checker only
        @property
        def device(self) -> torch.device: ...
        @property
        def num_processes(self) -> int: ...

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide gradients by the fp16 loss scale (done for you by the ``clip_grad_*`` methods)."""
        targets = (self.prepared.optimizers if optimizer is None
                   else (optimizer if isinstance(optimizer, list) else [optimizer]))
        for opt in targets:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the total gradient norm (after unscaling fp16 gradients); returns the norm before clipping.

        Under DeepSpeed the engine clips (set ``gradient_clipping`` in its config); this returns
        the engine's last global gradient norm (``None`` before its first step).

        Example:
            >>> if accelerator.sync_gradients:                                   # doctest: +SKIP
            ...     accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """
        if self.deepspeed_engine is not None:
            norm = self.deepspeed_engine.get_global_grad_norm()
            return None if norm is None else torch.as_tensor(float(norm))
        parameters = [p for p in parameters if p.grad is not None] if not torch.is_tensor(parameters) else [parameters]
        self._xla_sync_gradients(parameters)
        self.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clip each gradient to ``[-clip_value, clip_value]`` (after unscaling fp16 gradients)."""
        parameters = [p for p in parameters if p.grad is not None] if not torch.is_tensor(parameters) else [parameters]
        self._xla_sync_gradients(parameters)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def _xla_sync_gradients(self, parameters: list[torch.Tensor]) -> None:
        """On XLA, all-reduce gradients before clipping (the optimizer step then skips its own reduce)."""
        if self.device.type != "xla" or self.num_processes == 1 or self.gradient_state.is_xla_gradients_synced:
            return
        import torch_xla.core.xla_model as xm

        xm.all_reduce("sum", [p.grad for p in parameters], scale=1.0 / self.num_processes)
        self.gradient_state.is_xla_gradients_synced = True
