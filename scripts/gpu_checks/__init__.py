"""The checks ``scripts/check_gpu.py`` runs on a machine with NVIDIA GPUs, one module per kind.

- :mod:`gpu_checks.runner`: what a check is, running them in order, one line each.
- :mod:`gpu_checks.first_use_checks`: what a new user meets first (a fresh process, ``nbaccel
  config --default``, CuPy first, the notebooks), each in a subprocess.
- :mod:`gpu_checks.workers`: the training code the checks launch on the GPUs.
- :mod:`gpu_checks.training_checks`: counting GPUs, collectives, data, precision, FSDP.
- :mod:`gpu_checks.model_checks`: device maps, offload and loading checkpoints onto a GPU.
- :mod:`gpu_checks.streaming_checks`: the streamed offload (run by ``scripts/check_gpu_loading.py``,
  not by ``check_gpu.py``; it touches CUDA in this process).
- :mod:`gpu_checks.lifecycle_checks`: choosing GPUs, failures, interrupts, magics, fp8, and
  launches after this process touched CUDA (last, on purpose).

The order of :data:`CHECKS` matters: every check before ``spawn-after-cuda-query`` leaves CUDA
untouched in this process (the work happens in launched workers, so fork stays possible).
"""

from __future__ import annotations

from gpu_checks import first_use_checks, lifecycle_checks, model_checks, training_checks
from gpu_checks.runner import Check

__all__ = ["CHECKS"]

CHECKS: list[Check] = [*first_use_checks.CHECKS, *training_checks.CHECKS, *model_checks.CHECKS,
                       *lifecycle_checks.CHECKS]
