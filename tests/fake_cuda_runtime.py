"""Importing this makes a CPU-only torch look like a CUDA build on a machine with 2 GPUs.

It is the simulated notebook parent for the fork tests, so import it only in a subprocess:
``cudaGetDeviceCount`` (torch's ``torch._C._cuda_getDeviceCount``) answers 2 and, as torch's
``poison_fork()`` does, registers a fork handler that marks every later child as a bad fork;
``torch.cuda._is_in_bad_fork()`` reads that mark. NVML cannot count (as with MIG UUIDs in
``CUDA_VISIBLE_DEVICES``), so torch itself would fall back to ``cudaGetDeviceCount``.
``calls`` lists the ``cudaGetDeviceCount`` calls made in this process (children's are theirs).
"""

from __future__ import annotations

import os

import torch

GPUS = 2
calls: list[int] = []
_state = {"bad_fork": False, "handler": False}


def _forked_child() -> None:
    _state["bad_fork"] = True


def _get_device_count() -> int:
    calls.append(os.getpid())
    if not _state["handler"]:
        os.register_at_fork(after_in_child=_forked_child)
        _state["handler"] = True
    return GPUS


torch._C._cuda_getDeviceCount = _get_device_count  # torch.cuda._is_compiled() now says True
torch.cuda._is_in_bad_fork = lambda: _state["bad_fork"]
torch.cuda._device_count_nvml = lambda: -1
