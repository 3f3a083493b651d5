"""The wrapped scheduler behaves like the scheduler it wraps, even half-built (as during unpickling)."""

from __future__ import annotations

import pickle

import pytest
import torch

from nbaccel import AcceleratedScheduler


def test_scheduler_forwards_attributes_and_survives_pickling():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    wrapped = AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), optimizer)
    assert wrapped.step_size == 2 and wrapped.get_last_lr() == [0.1]
    assert pickle.loads(pickle.dumps(wrapped)).step_size == 2
    half_built = AcceleratedScheduler.__new__(AcceleratedScheduler)  # no `scheduler` yet: no endless recursion
    with pytest.raises(AttributeError, match="scheduler"):
        half_built.step_size  # noqa: B018 - reading the attribute is what must raise
