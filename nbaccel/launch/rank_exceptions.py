"""A rank's exception across the process boundary: packed in the rank, rebuilt in the caller in the failure family.

In the rank, :func:`pack_exception` pickles the exception; when it will not pickle or unpickle as
it is (its ``__reduce__`` raises, its ``__init__`` cannot take its own ``args``), its parts go
instead: the class by reference, ``args`` and the attributes that pickle (else ``None`` and a note
saying why). In the caller, :func:`unpack_exception` rebuilds it from either, without calling the
class's ``__init__`` again, and :func:`in_family` makes it an instance of its own type *and* of
:class:`~nbaccel.errors.WorkerFailedError` (and so of torch elastic's ``ChildFailedError``).

The joined type is named as the rank's type, so a traceback reads ``KeyError: ...``. A type that
``WorkerFailedError`` already derives from (``RuntimeError``, ``Exception``, ``LaunchError``) cannot
come before it in a class's bases, and needs no joining: its joined type is ``WorkerFailedError``'s
own, under the rank's type's name.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from nbaccel.errors import WorkerFailedError, child_failed_bases
from nbaccel.launch.payload import dumps_by_reference_first, loads

__all__ = ["ExceptionParts", "in_family", "joined_type", "pack_exception", "unpack_exception"]


@dataclass(frozen=True)
class ExceptionParts:
    """An exception that does not pickle as itself, in parts the caller rebuilds it from.

    Attributes:
        kind: its class (pickled by reference where it can be named).
        args: its ``args`` (``(str(exc),)`` when they do not pickle).
        state: the attributes in its ``__dict__`` that pickle.
    """

    kind: type
    args: tuple
    state: dict


def pack_exception(exc: BaseException) -> tuple[bytes | None, str]:
    """``(pickled, "")``: ``exc`` (or its parts) as bytes the caller can rebuild; ``(None, why)`` where neither works.

    Example:
        >>> class Odd(ValueError):
        ...     def __reduce__(self):
        ...         raise TypeError("no pickling")
        >>> data, why = pack_exception(Odd("bad value"))
        >>> type(unpack_exception(data)).__name__, why
        ('Odd', '')
    """
    try:
        data = dumps_by_reference_first(exc)
        if isinstance(pickle.loads(data), BaseException):
            return data, ""
        whole = "it unpickled as something else"
    except Exception as error:  # noqa: BLE001 - any failure: try its parts
        whole = f"pickling it raised {type(error).__name__}: {error}"
    try:
        state = {k: v for k, v in getattr(exc, "__dict__", {}).items() if _pickles(v)}
        args = exc.args if _pickles(exc.args) else (_text(exc),)
        data = dumps_by_reference_first(ExceptionParts(type(exc), args, state))
        unpack_exception(data)  # proves the caller can rebuild it (the class is the same in the caller)
        return data, ""
    except Exception as error:  # noqa: BLE001 - the caller says why, with this text
        parts = f"rebuilding it from its class and arguments raised {type(error).__name__}: {error}"
    return None, f"{whole}; {parts}"


def _pickles(value: Any) -> bool:
    try:
        dumps_by_reference_first(value)
        return True
    except Exception:  # noqa: BLE001 - left out
        return False


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__
        return f"<a {type(exc).__name__} whose str() raised>"


def unpack_exception(data: bytes) -> BaseException:
    """The exception :func:`pack_exception` packed (rebuilt from its parts where it was sent in parts).

    Raises:
        Exception: whatever unpickling or rebuilding raised (the caller reports it as the reason).
    """
    value = loads(data)
    if isinstance(value, ExceptionParts):
        return _rebuild(value.kind, value.args, value.state)
    if not isinstance(value, BaseException):
        raise TypeError(f"expected an exception, got a {type(value).__name__}")
    return value


def _rebuild(kind: type[BaseException], args: tuple, state: dict,
             made: type[BaseException] | None = None) -> BaseException:
    """An instance of ``made`` (default ``kind``) holding ``args`` and ``state``,
    without ``kind``'s own ``__init__``."""
    made = made or kind
    exc = made.__new__(made, *args)
    # A built-in type's __init__ only stores its arguments (UnicodeError's fields, say); a user's own
    # __init__ may transform them, and its result is already in args and state: not called again.
    init_owner = next(k for k in kind.__mro__ if "__init__" in k.__dict__)
    (init_owner.__dict__["__init__"] if init_owner.__module__ == "builtins" else BaseException.__init__)(exc, *args)
    exc.__dict__.update(state)
    return exc


_JOINED: dict[type[BaseException], type[BaseException]] = {}


def joined_type(kind: type[BaseException]) -> type[BaseException] | None:
    """``kind`` joined with :class:`WorkerFailedError` (cached), or ``None`` where it cannot or must not be.

    Example:
        >>> joined = joined_type(RuntimeError)
        >>> joined.__name__, issubclass(joined, RuntimeError), issubclass(joined, WorkerFailedError)
        ('RuntimeError', True, True)
    """
    if issubclass(kind, WorkerFailedError):
        return kind
    if not issubclass(kind, Exception):  # SystemExit, KeyboardInterrupt: reported, never raised as themselves
        return None
    joined = _JOINED.get(kind)
    if joined is None:
        # An ancestor of WorkerFailedError (RuntimeError, Exception) cannot precede it in the bases.
        bases = (WorkerFailedError,) if issubclass(WorkerFailedError, kind) else (kind, WorkerFailedError)
        try:
            joined = type(kind.__name__, (*bases, *child_failed_bases()), {
                "__module__": kind.__module__, "__qualname__": kind.__qualname__, "__doc__": kind.__doc__,
                "__reduce__": _reduce_joined, "_rank_type": kind})
        except TypeError:  # a final or layout-incompatible exception type
            return None
        _JOINED[kind] = joined
    return joined


def _reduce_joined(self: BaseException) -> tuple:
    return (_rebuild_joined, (type(self)._rank_type, self.args, dict(self.__dict__)))  # type: ignore[attr-defined]  # set on the joined classes built at run time


def _rebuild_joined(kind: type[BaseException], args: tuple, state: dict) -> BaseException:
    return _rebuild(kind, args, state, joined_type(kind) or kind)


def in_family(exc: BaseException, failures: tuple) -> BaseException:
    """``exc`` as an instance of its own type and of :class:`WorkerFailedError`, carrying ``failures``."""
    joined = joined_type(type(exc))
    if joined is not None and joined is not type(exc):
        try:
            rebuilt = _rebuild(type(exc), exc.args, dict(exc.__dict__), joined)
            for name in ("errno", "strerror", "filename", "filename2"):  # OSError's own fields
                if hasattr(exc, name) and getattr(rebuilt, name, None) != getattr(exc, name):
                    setattr(rebuilt, name, getattr(exc, name))
            exc = rebuilt
        except Exception:  # noqa: BLE001 - an odd constructor: keep the exception as it came
            pass
    try:
        exc.failures = failures  # type: ignore[attr-defined]  # added to an exception of any type
        if not isinstance(exc, WorkerFailedError):
            exc.launch_failures = failures  # type: ignore[attr-defined]  # added to an exception of any type
    except AttributeError:  # an exception type without a __dict__
        pass
    return exc
