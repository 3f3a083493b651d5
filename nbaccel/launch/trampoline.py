"""Entry point of a spawned worker: ``python -m nbaccel.launch.trampoline SPEC_FILE PAYLOAD_FILE``.

The spec (rank, environment, descriptors) and the cloudpickled ``(function, args, kwargs)`` come
from private files the supervisor wrote; the worker's fd 1 and 2 are already the supervisor's
pipes.
"""

from __future__ import annotations

import os
import pickle
import sys


def main(argv: list[str]) -> None:
    """Load the spec and payload named in ``argv`` and run the worker."""
    spec_path, payload_path = argv
    with open(spec_path, "rb") as handle:
        spec = pickle.load(handle)
    from nbaccel.launch.worker import die_with_parent, run_worker

    die_with_parent(spec.parent_pid)
    try:
        with open(payload_path, "rb") as handle:
            function, args, kwargs = pickle.load(handle)
    except BaseException as exc:  # noqa: BLE001 - report it like any worker failure
        def function(*_: object, _exc: BaseException = exc) -> None:
            raise _exc
        args, kwargs = (), {}
    run_worker(spec, function, args, kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # pragma: no cover - run_worker never returns
