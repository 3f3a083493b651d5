"""Serializing what crosses the process boundary: the function for spawned workers, and results.

Functions travel by value through cloudpickle, so what a notebook cell defines works under spawn;
when something cannot be pickled, :func:`dumps_payload` names the object and where it was found.
"""

from __future__ import annotations

import copy
import pickle
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import cloudpickle

from nbaccel.errors import LaunchError, PayloadPicklingError

__all__ = ["cpu_copies", "dumps_by_reference_first", "dumps_payload", "dumps_result", "find_unpicklable", "load_result",
           "loads", "to_cpu"]


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples, sets) detached and moved to CPU.

    A returned ``nn.Module`` is moved to CPU in place (the worker is about to exit): unpickled on
    its GPU it would initialize CUDA in the notebook, and later launches could no longer fork.
    """
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" or value.requires_grad else value
    if isinstance(value, torch.nn.Module):
        return value.cpu()
    if isinstance(value, dict):
        items = [(k, to_cpu(v)) for k, v in value.items()]
        try:
            return type(value)(items)
        except TypeError:  # a dict subclass with another constructor
            return dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(to_cpu(v) for v in value)
    return value


def cpu_copies(value: Any) -> Any:
    """``value`` with every module on an accelerator replaced by a CPU copy; the worker's own stays where it is.

    A launch's worker is about to exit, so its results move modules to CPU in place
    (:func:`to_cpu`); a warm rank (a pool's, a Ray actor's) keeps using them (``-o model`` must
    not pull every later cell's ``model`` off its GPU). Copies are made tensor by tensor, straight
    to CPU, so the accelerator never holds two copies.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> cpu_copies({"m": layer})["m"] is layer      # already on CPU: sent as it is
        True
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.nn.Module):
        tensors = [*value.parameters(), *value.buffers()]
        if all(t.device.type == "cpu" for t in tensors):
            return value
        memo: dict[int, Any] = {}
        for tensor in tensors:
            copy_ = tensor.detach().cpu()
            memo[id(tensor)] = (torch.nn.Parameter(copy_, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, torch.nn.Parameter) else copy_)
        return copy.deepcopy(value, memo)
    if isinstance(value, dict):
        return {k: cpu_copies(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple (a cell's CellResult)
        return type(value)(*(cpu_copies(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copies(v) for v in value)
    return value


def find_unpicklable(candidates: Iterable[tuple[str, Any]]) -> tuple[str, Any, Exception] | None:
    """The first ``(path, object)`` of ``candidates`` that cloudpickle refuses, with its error.

    The one finder of "the object that will not pickle", for functions shipped to spawned
    workers and for a cell's notebook variables alike.

    Example:
        >>> import threading
        >>> find_unpicklable([("args[0]", 1), ("args[1]", threading.Lock())])[0]
        'args[1]'
    """
    for path, obj in candidates:
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the answer
            return path, obj, exc
    return None


def _globals_used(function: Callable[..., Any]) -> list[tuple[str, Any]]:
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    names: set[str] = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    glb = getattr(function, "__globals__", {})
    return [(n, glb[n]) for n in sorted(names) if n in glb]


def _find_culprit(function: Callable[..., Any], args: Sequence[Any],
                  kwargs: Mapping[str, Any]) -> tuple[str, Any, Exception] | None:
    candidates: list[tuple[str, Any]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    candidates += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    name = getattr(function, "__qualname__", repr(function))
    for i, cell in enumerate(getattr(function, "__closure__", None) or ()):
        var = function.__code__.co_freevars[i]
        try:
            candidates.append((f"{name} closure variable {var!r}", cell.cell_contents))
        except ValueError:
            continue
    candidates += [(f"{name}.__globals__[{n!r}]", v) for n, v in _globals_used(function)]
    return find_unpicklable(candidates)


def dumps_payload(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """Pickle ``(function, args, kwargs)`` by value for spawned workers.

    Raises:
        PayloadPicklingError: something cannot be pickled; the error names it and where it is.
    """
    try:
        return cloudpickle.dumps((function, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        found = _find_culprit(function, args, kwargs)
        if found is None:
            path, obj, error = "the function", function, exc
        else:
            path, obj, error = found
        type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        msg = (f"cannot send {path} (a {type_name}) to spawned workers: {error}. Spawned workers get "
               "the function and its arguments by pickling. Fix: create that object inside the "
               "function instead of passing it in, or use start_method='fork' where fork is safe.")
        raise PayloadPicklingError(msg, object_path=path, object_type=type_name) from exc


def dumps_by_reference_first(value: Any) -> bytes:
    """Pickle ``value`` naming its classes by reference where they can be found, else by value.

    A forked worker shares the launching process's classes, notebook-defined ones included:
    naming them keeps ``isinstance`` and ``except MyError`` true in the caller. cloudpickle would
    copy a ``__main__`` class by value, and the caller would get a look-alike class. Objects plain
    pickle cannot name (lambdas, classes made inside a spawned worker) still travel by value.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything plain pickle refuses goes by value
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def dumps_result(value: Any) -> bytes:
    """Pickle a worker's return value (tensors moved to CPU first), classes by reference first."""
    return dumps_by_reference_first(to_cpu(value))


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps_payload` or :func:`dumps_result` wrote (trusted, own children)."""
    return pickle.loads(data)


def load_result(rank: int, data: bytes) -> Any:
    """Unpickle rank ``rank``'s return value, or say plainly why it cannot live in this process."""
    try:
        return loads(data)
    except Exception as exc:  # any unpickling failure gets the same explanation
        missing = f" (module {exc.name!r} is not importable here)" if isinstance(exc, ImportError) and exc.name else ""
        raise LaunchError(
            f"rank {rank} finished, but its return value cannot be unpickled in this process{missing}: "
            f"{type(exc).__name__}: {exc}. The workers ran to the end; only the value could not come back. "
            "Fix: return plain data (numbers, strings, lists, dicts, tensors, numpy arrays), or import what "
            "it is made of here before launching.") from exc

