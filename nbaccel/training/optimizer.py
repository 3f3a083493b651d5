"""`AcceleratedOptimizer`: an optimizer that steps only when gradients are synchronized.

While gradients accumulate (``sync_gradients`` is ``False``) ``step`` and ``zero_grad`` do
nothing. With fp16 the step goes through the ``GradScaler``, and ``step_was_skipped`` tells
whether it skipped the update because gradients overflowed. On XLA, gradients are all-reduced
with ``xm.reduce_gradients`` before the step (unless ``clip_grad_norm_`` already did), and the
step ends with ``torch_xla.sync()`` so each optimizer step is one executed graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nbaccel.errors import EnvironmentStateError
from nbaccel.nested_data import send_to_device
from nbaccel.training.gradient_state import GradientState

__all__ = ["AcceleratedOptimizer"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; everything not listed here is the wrapped optimizer's.

    Args:
        optimizer: the optimizer to wrap.
        device_placement: move a loaded state to the parameters' device.
        scaler: the fp16 ``GradScaler``, if any.
        gradient_state: the accelerator's accumulation state.

    Example:
        >>> opt = AcceleratedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
        >>> opt.step_was_skipped
        False
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True,
                 scaler: torch.amp.GradScaler | None = None, gradient_state: GradientState | None = None,
                 device: torch.device | None = None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = gradient_state or GradientState()
        self.device_placement = device_placement
        self.device = device
        self._is_overflow = False
        self._unscaled = False
        self._on_xla = device is not None and device.type == "xla"
        if device_placement and device is not None and optimizer.state:
            optimizer.load_state_dict(_placed(optimizer.state_dict(), device))

    # The wrapped optimizer's own attributes, seen through the wrapper.
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.device_placement and self.device is not None:
            state_dict = _placed(state_dict, self.device)
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, except while they accumulate."""
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_(self) -> None:
        """Divide gradients by the fp16 loss scale (once per step; a no-op without a scaler).

        Raises:
            EnvironmentStateError: with a scaler, on a micro-step that does not sync gradients:
                the next backward would add scaled gradients to these unscaled ones (torch's
                ``GradScaler`` refuses a second ``unscale_`` before ``update``, as in Accelerate).
        """
        if self.scaler is None or self._unscaled:
            return
        if not self.gradient_state.sync_gradients:
            raise EnvironmentStateError(
                "clip_grad_norm_/clip_grad_value_/unscale_gradients was called with mixed_precision='fp16' on a "
                "gradient accumulation step that does not sync gradients (sync_gradients=False): fp16 gradients "
                "can be unscaled once per optimizer step, and the next backward would add scaled gradients to the "
                "unscaled ones. Fix: clip only when gradients sync: `if accelerator.sync_gradients: "
                "accelerator.clip_grad_norm_(model.parameters(), max_norm)`")
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Update the parameters, unless gradients are still accumulating."""
        if not self.gradient_state.sync_gradients:
            return None
        self._xla_reduce_gradients()
        if self.scaler is None:
            self._is_overflow = False
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            scale_before = self.scaler.get_scale()
            result = (self.scaler.step(self.optimizer, closure) if closure is not None
                      else self.scaler.step(self.optimizer))
            self.scaler.update()
            self._unscaled = False
            self._is_overflow = self.scaler.get_scale() < scale_before
        if self._on_xla:
            self.gradient_state.is_xla_gradients_synced = False  # the next step's gradients are new
            xla_sync()
        return result

    def _xla_reduce_gradients(self) -> None:
        if not self._on_xla or self.gradient_state.is_xla_gradients_synced:
            return
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(self.optimizer)
        self.gradient_state.is_xla_gradients_synced = True

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` skipped the update (fp16 overflow)."""
        return self._is_overflow

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have one (schedule-free optimizers)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have one (schedule-free optimizers)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def _placed(state_dict: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state_dict`` with its state on ``device``, except step counters that torch keeps on CPU.

    Adam-style optimizers keep ``step`` as a CPU tensor unless ``capturable`` or ``fused``: on the
    GPU, reading it each step would cost a device sync per parameter (torch's ``load_state_dict``
    leaves ``step`` where it finds it, so it must not arrive on the GPU).
    """
    on_device: set[Any] = set()
    for group in state_dict.get("param_groups", []):
        if group.get("capturable") or group.get("fused"):
            on_device.update(group.get("params", []))
    state = {pid: {key: (value.cpu() if key == "step" and torch.is_tensor(value) and pid not in on_device
                         else send_to_device(value, device))
                   for key, value in entries.items()}
             for pid, entries in state_dict.get("state", {}).items()}
    return {**state_dict, "state": state}


def xla_sync() -> None:
    """End the XLA step: compile and run the graph built so far (``torch_xla.sync``, ``mark_step`` before 2.6).

    Without it, a loop that does not iterate a device loader (which syncs per batch) would grow one
    lazy graph across steps.
    """
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # pragma: no cover - torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()
