"""Importing what DDP needs once, in the caller, so forked workers inherit it; never on a trivial launch's path.

The first ``DistributedDataParallel`` built in a process imports ``torch._dynamo``: about 1 s
here, and about 2 s in *each* of 4 workers that share 2 cores. So it is imported in the caller:
in a background thread started when the extension loads, and at the start of a launch whose
function looks like it builds a model (:func:`may_build_ddp`); never on the path of a launch that
does not need it. The public ``nbaccel`` names a launched function uses are imported before
forking too (:func:`import_used_exports`).

Forking while another thread is in the middle of an import would leave the child with a
half-initialized module and a module lock nobody will release, so the thread is always joined
before any fork in this process: by the launchers, and by an ``os.register_at_fork`` hook.
"""

from __future__ import annotations

import ast
import gc
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["finish_warmup", "import_used_exports", "may_build_ddp", "prepare_to_fork", "source_names", "start_warmup",
           "used_names", "warmed_up"]

# Names whose presence in a function (or the functions it calls) suggests it builds a DDP/FSDP model.
_DDP_NAMES = frozenset({
    "DistributedDataParallel", "DDP", "prepare", "prepare_model", "fully_shard",
    "FullyShardedDataParallel", "FSDP", "compile",
})
_MODULES = ("torch._dynamo", "torch.nn.parallel")
_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = False


def _import_all() -> None:
    global _done
    try:
        for name in _MODULES:
            __import__(name)
    except Exception:  # noqa: BLE001 - a worker then imports it itself, as it would without nbaccel
        pass
    _done = True


def warmed_up() -> bool:
    """Whether the DDP imports are in this process already."""
    return _done


def start_warmup() -> None:
    """Begin importing what DDP needs in a background thread (once; only where torch is imported)."""
    global _thread
    with _lock:
        if _done or _thread is not None or "torch" not in sys.modules:
            return
        _thread = threading.Thread(target=_import_all, name="nbaccel-warmup", daemon=True)
        _thread.start()


def finish_warmup() -> None:
    """Wait for a warm-up in progress (call before forking); returns at once when none runs."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _names_of(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_of(const)
    return names


def _function_names(function: Any, depth: int = 3, seen: set[int] | None = None) -> set[str]:
    """Global and attribute names used by ``function`` and, a few calls deep, the functions it calls."""
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen:
        return set()
    seen.add(id(code))
    names = _names_of(code)
    if depth > 0:
        globals_ = getattr(function, "__globals__", {})
        callees = [globals_[name] for name in names & set(globals_)]
        for cell in getattr(function, "__closure__", None) or ():
            try:
                callees.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        for callee in callees:
            if isinstance(callee, types.FunctionType):
                names |= _function_names(callee, depth - 1, seen)
    return names


def source_names(source: str) -> set[str]:
    """Every name and attribute name in Python ``source`` (empty when it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
    return found


def used_names(function: Callable[..., Any] | None = None, names: Iterable[str] = (),
               namespace: Mapping[str, Any] | None = None) -> set[str]:
    """The names ``function`` (a few calls deep) and ``names`` use, with the functions ``namespace`` defines among them.

    Example:
        >>> sorted(used_names(names=["Accelerator", "x"]))
        ['Accelerator', 'x']
    """
    used = set(names)
    if function is not None:
        used |= _function_names(function)
    for name in list(used & set(namespace or {})):
        value = namespace[name]  # type: ignore[index]  # namespace is not None: used is empty otherwise
        if isinstance(value, types.FunctionType):
            used |= _function_names(value)
    return used


def may_build_ddp(function: Callable[..., Any] | None = None, names: Iterable[str] = (),
                  namespace: Mapping[str, Any] | None = None) -> bool:
    """A cheap guess: does ``function`` (or code using ``names``) build a DDP or FSDP model?

    Functions among ``names`` that ``namespace`` defines (a notebook's, for a cell) are read too.
    A wrong "no" costs what a launch without nbaccel's warm-up costs (each worker imports it);
    a wrong "yes" costs one import in the caller, once per process. Making an ``Accelerator``
    is not a yes: only preparing a model builds one.

    Example:
        >>> may_build_ddp(lambda: 1), may_build_ddp(names=["Accelerator"]), may_build_ddp(names=["prepare"])
        (False, False, True)
    """
    return bool(used_names(function, names, namespace) & _DDP_NAMES)


def import_used_exports(used: Iterable[str]) -> None:
    """Import here, before forking, the modules behind the public ``nbaccel`` names in ``used``.

    ``from nbaccel import Accelerator`` in a function costs about 0.05 s in this process, but
    0.3-0.7 s in *each* of 4 forked workers sharing 2 cores (their first touches of the parent's
    memory copy its pages); done once here, workers find the module imported. Names whose
    import fails are left to the workers, which then raise as they would have.

    Example:
        >>> import_used_exports(["notebook_launcher", "not_an_export"])
    """
    import importlib

    from nbaccel.exports import EXPORTS

    missing = sorted({EXPORTS[name] for name in set(used) & set(EXPORTS)} - set(sys.modules))
    if not missing:
        return
    # An import allocates enough to set off a full collection, which walks every object the caller
    # holds: 70-80 ms of the 0.12 s that importing Accelerator took here with torch imported, in
    # the middle of the launch. Held off, the collection comes when the caller next allocates
    # enough, as it would have without this import.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for module in missing:
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - e.g. a missing optional dependency: the worker reports it
                continue
    finally:
        if collecting:
            gc.enable()


def prepare_to_fork(function: Callable[..., Any], warm_imports: bool | None = None) -> None:
    """Get the caller ready to fork workers that will run ``function``.

    Import ``torch._dynamo`` first when ``warm_imports`` says so (``None``: when ``function``
    looks like it builds a model), and the public nbaccel names it uses. Then wait for any
    background import, because no fork may happen in the middle of one.
    """
    if may_build_ddp(function) if warm_imports is None else warm_imports:
        start_warmup()
    import_used_exports(used_names(function))
    finish_warmup()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=finish_warmup)
