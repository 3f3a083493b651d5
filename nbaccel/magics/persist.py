"""A ``%%accel_launch --persist`` cell: a cell program that runs in a warm worker's lasting namespace.

Each rank of the pool keeps one namespace (:func:`~nbaccel.launch.pool.serve.worker_namespace`)
for every persisted cell, so a name defined in one cell is there in the next, in that rank. The
notebook seeds it as ``%%accel_launch`` does under spawn: the notebook names the cell reads are
sent with it. Who wins when both have a name:

- a name the workers assigned themselves (in an earlier persisted cell) is theirs: the
  notebook's value never replaces it (so ``-o model`` bringing rank 0's copy back to the
  notebook does not overwrite every rank's own ``model`` in the next cell);
- a name that only ever came from the notebook is refreshed from it in every cell (redefine a
  function in the notebook, and the next persisted cell uses the new one).

Functions sent from the notebook get the worker namespace as their globals, so they see the
names the persisted cells define (``def evaluate(): return model(x)`` in the notebook works).
"""

from __future__ import annotations

import types
from typing import Any

from nbaccel.launch.pool.serve import worker_namespace
from nbaccel.magics.cell import CellProgram

__all__ = ["PersistentCellProgram"]

# In a worker: what the notebook seeded, by name, as it was sent (a different object there now:
# a persisted cell assigned the name, and it belongs to the workers from then on).
_seeded: dict[str, Any] = {}


def _rebound(value: Any, ns: dict[str, Any]) -> Any:
    """A notebook function, as if defined in ``ns`` (its globals); anything else as it is."""
    if not (isinstance(value, types.FunctionType) and value.__module__ == "__main__"):
        return value
    function = types.FunctionType(value.__code__, ns, value.__name__, value.__defaults__, value.__closure__)
    function.__kwdefaults__ = value.__kwdefaults__
    function.__dict__.update(value.__dict__)
    function.__qualname__ = value.__qualname__
    return function


class PersistentCellProgram(CellProgram):
    """A :class:`~nbaccel.magics.cell.CellProgram` run in the worker's lasting namespace.

    Example:
        >>> program = PersistentCellProgram("kept = 2", filename="<cell>", first_line=2,
        ...                                 cell_lines=["%%accel_launch --persist\\n", "kept = 2\\n"], user_ns={})
        >>> import pickle; from nbaccel.magics.cell import run_cell_program
        >>> _ = run_cell_program(pickle.loads(pickle.dumps(program)))
        >>> worker_namespace()["kept"]
        2
    """

    def namespace(self) -> dict[str, Any]:
        """The rank's lasting namespace, with this cell's notebook names seeded where the workers have none."""
        ns = worker_namespace()
        for name in [n for n, sent in _seeded.items() if ns.get(n, _seeded) is not sent]:
            del _seeded[name]  # a persisted cell assigned (or deleted) it: the workers' own now
        for name, value in _with_function_globals(self.shipped_values()).items():
            if name not in ns or name in _seeded:
                ns[name] = _seeded[name] = _rebound(value, ns)
        return ns


def _with_function_globals(shipped: dict[str, Any]) -> dict[str, Any]:
    """``shipped`` plus the notebook globals its functions use (cloudpickle sent them in one shared dict)."""
    found = dict(shipped)
    for value in shipped.values():
        if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
            for name, used in value.__globals__.items():
                if not name.startswith("__"):
                    found.setdefault(name, used)
    return found
