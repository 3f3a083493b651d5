"""A notebook cell as a program that runs in every worker, and what comes back from it.

The cell body is compiled with line numbers that match the cell as the user sees it (the
``%%accel_launch`` line is line 1), with its last expression kept as the cell's value. Under
fork it runs in the worker's copy of the notebook namespace (by reference, nothing copied).
Under spawn only the names the cell uses travel, by value through cloudpickle, and notebook
functions see the cell's own assignments as their globals, as they would in the notebook.
"""

from __future__ import annotations

import ast
import linecache
import symtable
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import cloudpickle

from nbaccel.errors import PayloadPicklingError
from nbaccel.identity import current_identity
from nbaccel.launch.payload import find_unpicklable

__all__ = ["CellProgram", "CellResult", "names_used", "run_cell_program"]

_LAST = "_nbaccel_last_value_"
LinecacheEntry = tuple[int, None, list[str], str]


class CellResult(NamedTuple):
    """What one rank sends back: the last expression's value and the ``-o`` names.

    A ``NamedTuple``, so tensors inside are moved to CPU on the way back.
    """

    value: Any
    outputs: dict[str, Any]


def names_used(source: str) -> set[str]:
    """The global names ``source`` reads: at module level, and free in its functions and classes.

    Example:
        >>> sorted(names_used("y = f(x)\\ndef g():\\n    return z"))
        ['f', 'x', 'z']
    """
    found: set[str] = set()

    def walk(table: symtable.SymbolTable, top: bool) -> None:
        for sym in table.get_symbols():
            if sym.is_referenced() and (top or sym.is_global()):
                found.add(sym.get_name())
        for child in table.get_children():
            walk(child, False)

    walk(symtable.symtable(source, "<cell>", "exec"), True)
    return found


def _compile(source: str, filename: str, first_line: int) -> tuple[types.CodeType, bool]:
    """Compile ``source`` so its line 1 is reported as ``first_line``; the last expression is kept."""
    try:
        tree = ast.parse(source, filename=filename, mode="exec")
    except SyntaxError as exc:  # report the line the user sees in the cell, not the body's
        if exc.lineno is not None:
            exc.lineno += first_line - 1
        if getattr(exc, "end_lineno", None) is not None:
            exc.end_lineno += first_line - 1  # type: ignore[operator]  # not None: checked just above
        raise
    keeps_value = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
    if keeps_value:
        last = tree.body[-1]
        assign = ast.Assign(targets=[ast.Name(id=_LAST, ctx=ast.Store())], value=last.value)  # type: ignore[attr-defined]  # an ast.Expr: checked in keeps_value
        tree.body[-1] = ast.copy_location(assign, last)
        ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, first_line - 1)
    return compile(tree, filename, "exec", dont_inherit=True), keeps_value


def _shared_globals(ns: Mapping[str, Any]) -> dict[str, Any]:
    """The globals dict that cloudpickle rebuilt for the notebook's functions, or a new one.

    Running the cell in that same dict means a notebook function called by the cell sees the
    names the cell assigns, exactly as in the notebook.
    """
    for value in ns.values():
        if (isinstance(value, types.FunctionType) and value.__module__ == "__main__"
                and value.__globals__.get("__name__") == "__main__"):
            return value.__globals__
    return {"__name__": "__main__"}


class CellProgram:
    """The body of an ``%%accel_launch`` cell, ready to run in every worker.

    Args:
        source: the cell body, already through IPython's input transformers.
        filename: the name its code is compiled under (and its source is cached under).
        first_line: the cell line number of the body's first line (2: after the magic line).
        cell_lines: the cell's lines as the user wrote them, shown in tracebacks.
        user_ns: the notebook namespace.
        hidden: names of IPython's own namespace entries, never sent to spawned workers.
        out_names: names returned from the workers (``-o``).
        all_ranks: return ``-o`` values from every rank, not only rank 0.
        sources: other cells' cached source, so spawned workers show their lines too.

    Raises:
        SyntaxError: the body is not valid Python (raised here, before anything starts).

    Example:
        >>> program = CellProgram("x = 2\\nx * 21", filename="<cell>", first_line=2,
        ...                       cell_lines=["%%accel_launch\\n", "x = 2\\n", "x * 21\\n"], user_ns={})
        >>> run_cell_program(program).value
        42
    """

    def __init__(self, source: str, *, filename: str, first_line: int, cell_lines: Sequence[str],
                 user_ns: dict[str, Any], hidden: Iterable[str] = (), out_names: Sequence[str] = (),
                 all_ranks: bool = False, sources: Mapping[str, LinecacheEntry] | None = None) -> None:
        self.source = source
        self.filename = filename
        self.first_line = first_line
        self.cell_lines = list(cell_lines)
        self.out_names = tuple(out_names)
        self.all_ranks = all_ranks
        self.sources = dict(sources or {})
        self._code, self.keeps_value = _compile(source, filename, first_line)
        self._user_ns: dict[str, Any] | None = user_ns
        self._hidden = frozenset(hidden)
        self._shipped: bytes | None = None

    # ------------------------------------------------------------------ spawn
    def shipped_names(self) -> list[str]:
        """The notebook names a spawned worker receives: those the cell reads, minus IPython's own."""
        ns = self._user_ns or {}
        return sorted(n for n in names_used(self.source)
                      if n in ns and n not in self._hidden and not n.startswith("__"))

    def _ship(self) -> bytes:
        ns = self._user_ns or {}
        names = self.shipped_names()
        try:
            return cloudpickle.dumps({n: ns[n] for n in names})
        except Exception as whole:  # noqa: BLE001 - find which name it was
            found = find_unpicklable((name, ns[name]) for name in names)
            culprit, exc = (found[0], found[2]) if found is not None else (None, whole)
            if culprit is None:  # each pickles alone; only together they fail
                what, type_name = "the notebook variables " + ", ".join(map(repr, names)), "dict"
            else:
                kind = type(ns[culprit])
                what, type_name = f"the notebook variable {culprit!r}", f"{kind.__module__}.{kind.__qualname__}"
            raise PayloadPicklingError(
                f"cannot send {what} (a {type_name}) to spawned workers: {exc}. Under spawn, the names a "
                "cell uses travel to the workers by pickling. Fix: create it inside the cell instead, or "
                "run with --start_method fork where fork is safe.",
                object_path=culprit or ", ".join(names), object_type=type_name) from exc

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_shipped"] = self._shipped if self._shipped is not None else self._ship()
        state["_user_ns"] = None
        state["_code"] = None  # recompiled from source in the worker
        state["_hidden"] = frozenset()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._code, _ = _compile(self.source, self.filename, self.first_line)

    # ------------------------------------------------------------------ worker
    def shipped_values(self) -> dict[str, Any]:
        """In a worker that received this program by pickling: the notebook names that came with it."""
        return cloudpickle.loads(self._shipped) if self._shipped else {}

    def namespace(self) -> dict[str, Any]:
        """Where the cell runs: the notebook's namespace (fork), or the names shipped with it (spawn)."""
        if self._user_ns is not None:
            return self._user_ns
        shipped = self.shipped_values()
        ns = _shared_globals(shipped)
        ns.update(shipped)
        return ns

    def register_sources(self) -> None:
        """Put the cell's (and earlier cells') lines in ``linecache`` so tracebacks show them."""
        for name, entry in self.sources.items():
            linecache.cache.setdefault(name, entry)
        text = "".join(self.cell_lines)
        linecache.cache[self.filename] = (len(text), None, list(self.cell_lines), self.filename)


def run_cell_program(program: CellProgram) -> CellResult | None:
    """Run ``program`` in this worker; rank 0 (every rank with ``all_ranks``) returns its results.

    Raises:
        NameError: an ``-o`` name was not defined by the cell (or the notebook).
    """
    program.register_sources()
    ns = program.namespace()
    ns.pop(_LAST, None)
    exec(program._code, ns)  # noqa: S102 - the user's own cell, run as the notebook would
    identity = current_identity()  # per replica thread on XLA, where the process environment is shared
    rank = identity.rank if identity is not None else 0
    value = ns.pop(_LAST, None)
    if rank != 0 and not program.all_ranks:
        return None
    outputs: dict[str, Any] = {}
    for name in program.out_names:
        if name not in ns:
            raise NameError(f"-o/--out names {name!r}, but the cell did not define it (rank {rank}). "
                            f"Fix: assign {name} in the cell, or drop it from -o.")
        outputs[name] = ns[name]
    return CellResult(value=value if rank == 0 else None, outputs=outputs)
