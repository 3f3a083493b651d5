"""Entry point of a spawned worker: ``python -m nbaccel.launch.worker.trampoline SPEC_FILE PAYLOAD_FILE``.

The spec and the cloudpickled ``(function, args, kwargs)`` come from private files the supervisor
wrote; fd 1 and 2 are already its pipes. CUDA tensors in the payload arrive on this worker's own
GPU, not on the notebook's ``cuda:N`` (which would create a context there in every rank).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from typing import Any


def _own_cuda_index() -> int:
    """The GPU this worker will use (as ``ProcessState`` picks it: local rank modulo the visible GPUs)."""
    from nbaccel.hardware import cuda_device_count

    return int(os.environ.get("LOCAL_RANK", "0")) % max(cuda_device_count(), 1)


def _to_own_device(storage: Any, location: str) -> Any:
    """``torch.load``'s ``map_location``: CUDA storages go to this worker's GPU, others stay as saved."""
    return storage.cuda(_own_cuda_index()) if location.startswith("cuda") else storage


def _load_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` with CUDA storages mapped to this worker's GPU."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=False, map_location=_to_own_device)


class PayloadUnpickler(pickle.Unpickler):
    """Unpickles a payload, placing CUDA tensors on this worker's own GPU."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        return super().find_class(module, name)


def main(argv: list[str]) -> None:
    """Load the spec and payload named in ``argv`` and run the worker."""
    spec_path, payload_path = argv
    with open(spec_path, "rb") as handle:
        spec = pickle.load(handle)
    from nbaccel.launch.worker.process import die_with_parent, run_worker

    die_with_parent(spec.parent_pid)
    try:
        with open(payload_path, "rb") as handle:
            function, args, kwargs = PayloadUnpickler(handle).load()
    except BaseException as exc:  # noqa: BLE001 - report it like any worker failure
        def function(*_: object, _exc: BaseException = exc) -> None:
            raise _exc
        args, kwargs = (), {}
    release_spawn_files(spec_path, payload_path)
    run_worker(spec, function, args, kwargs)


def release_spawn_files(spec_path: str, payload_path: str) -> None:
    """Remove this worker's spec; the last worker to have read the payload removes it and the folder.

    The launcher writes every spec before starting any worker, so no spec left means every worker
    has read the payload. The launcher removes the folder too when the launch ends; this is for a
    launcher killed while its workers run.
    """
    folder = os.path.dirname(spec_path)
    try:
        os.unlink(spec_path)
        if not any(name.startswith("spec-") for name in os.listdir(folder)):
            os.unlink(payload_path)
            os.rmdir(folder)
    except OSError:  # another worker got there first, or the launcher already cleaned up
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # pragma: no cover - run_worker never returns
