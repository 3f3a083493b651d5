"""`AcceleratedScheduler`: a learning-rate scheduler stepped the way Accelerate steps it.

It steps only after a real optimizer step: not while gradients accumulate, not when the fp16
scaler skipped the update. Without ``split_batches`` it steps ``num_processes`` times per
optimizer step, so a schedule written for single-process steps ends at the same point when the
data is spread over ``n`` processes.
"""

from __future__ import annotations

import warnings
from typing import Any

from nbaccel.training.gradient_state import GradientState

__all__ = ["AcceleratedScheduler"]


class AcceleratedScheduler:
    """Wraps ``scheduler``; everything not listed here is the wrapped scheduler's.

    Args:
        scheduler: the ``torch.optim.lr_scheduler`` object.
        optimizers: the prepared optimizer(s) it follows (for ``step_was_skipped``).
        step_with_optimizer: step together with the optimizer (else once per call).
        split_batches: batches are split, so one optimizer step is one schedule step.
        num_processes: schedule steps per optimizer step otherwise.
        gradient_state: the accelerator's accumulation state.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        >>> sched = AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), opt)
        >>> opt.step(); sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True, split_batches: bool = False,
                 num_processes: int = 1, gradient_state: GradientState | None = None) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.num_processes = num_processes
        self.gradient_state = gradient_state or GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule after a real optimizer step (``num_processes`` times unless ``split_batches``)."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        with warnings.catch_warnings():
            # torch warns when the scheduler steps "before" a scaler-skipped optimizer step.
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            if self.split_batches:
                self.scheduler.step(*args, **kwargs)
                return
            for _ in range(self.num_processes):
                total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to pass its end
                if total is not None and self.scheduler.last_epoch >= total:
                    break
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
