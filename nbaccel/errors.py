"""The exceptions nbaccel raises, in one tree.

::

    NbaccelError
    ├── ConfigError (also ValueError)      a config file, flag or argument is invalid
    ├── EnvironmentStateError (also RuntimeError)
    │                                      the process is in a state that forbids the action
    │                                      (for example CUDA initialized before a fork)
    ├── LaunchError (also RuntimeError)    a launch could not start or did not finish
    │   ├── PayloadPicklingError           the function or an argument cannot be shipped
    │   ├── WorkerFailedError              a worker raised, exited non-zero or was killed (the
    │   │                                  family of every failed launch; a worker's own Exception
    │   │                                  type, RuntimeError and Exception included, is joined in
    │   │                                  when it re-raises here; a worker's SystemExit or
    │   │                                  KeyboardInterrupt is reported as one, never raised as
    │   │                                  itself; also torch elastic's ChildFailedError, as
    │   │                                  Accelerate raises)
    │   │   └── ProcessExitedError         ... without reporting an exception (os._exit, signal)
    │   ├── LaunchTimeoutError (also TimeoutError)
    │   │                                  the launch ran past ``timeout`` or hung
    │   └── WorkerPoolError                a warm pool cannot run: it is closed, or dead
    │                                      (a worker died); ``restart()`` it
    ├── MissingDependencyError (also ImportError)
    │                                      an optional package a setting needs is not installed
    └── DistributedOperationError (also RuntimeError)
                                           a collective got mismatched inputs across processes

    Big-model inference (also under NbaccelError):
    ConfigError (see above)
    └── DeviceMapError                     a device map names an unknown module or device,
                                           or leaves part of the model unplaced
    CheckpointError (also ValueError)      a checkpoint file cannot be read (missing, truncated,
    │                                      corrupt, unknown format)
    ├── UnsafeCheckpointError              a pickle checkpoint would run code; refused unread
    ├── CheckpointMismatchError            checkpoint and model disagree (missing or unexpected
    │                                      keys, shape mismatches)
    └── CheckpointDiskFullError            ``save_state`` ran out of disk space; its partial copy
                                           was removed, the previous checkpoint is intact

Exceptions raised *inside* a worker are re-raised in the caller as their own type *and* as a
``WorkerFailedError`` (and ``ChildFailedError``); every rank's failure, root cause first, travels on
them as ``failures`` (also ``launch_failures``); see :mod:`nbaccel.launch.failures` and
:mod:`nbaccel.launch.rank_exceptions`.
"""

from __future__ import annotations

__all__ = [
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "DeviceMapError",
    "DistributedOperationError",
    "DistributedOperationException",
    "EnvironmentStateError",
    "LaunchError",
    "LaunchTimeoutError",
    "MissingDependencyError",
    "NbaccelError",
    "PayloadPicklingError",
    "ProcessExitedError",
    "UnsafeCheckpointError",
    "WorkerFailedError",
    "WorkerPoolError",
    "child_failed_bases",
]


def _rebuild_error(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    exc = cls.__new__(cls, *args)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class NbaccelError(Exception):
    """Base class of every error nbaccel raises itself.

    Instances pickle with their fields, so an error raised in a worker arrives whole.
    """

    def __reduce__(self) -> tuple:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


_MAX_MESSAGE_CHARS = 2000
"""The longest message a :class:`ConfigError` carries: a value quoted in it (a huge string from a
config file, say) is cut in the middle, keeping the start and the closing "Fix: ..."."""


def _bounded(msg: str) -> str:
    if len(msg) <= _MAX_MESSAGE_CHARS:
        return msg
    cut = len(msg) - _MAX_MESSAGE_CHARS + 60
    return f"{msg[:1200]} [... {cut:,} characters left out ...] {msg[1200 + cut:]}"


class ConfigError(NbaccelError, ValueError):
    """A configuration value is invalid.

    Attributes:
        key: the offending key or argument name.
        value: the offending value.
        valid: a description of the valid values.
    """

    def __init__(self, msg: str, *, key: str | None = None, value: object = None,
                 valid: object = None) -> None:
        super().__init__(_bounded(msg))
        self.key = key
        self.value = value
        self.valid = valid


class EnvironmentStateError(NbaccelError, RuntimeError):
    """The current process state forbids the requested action."""


class LaunchError(NbaccelError, RuntimeError):
    """A launch could not start, or did not finish normally."""


class PayloadPicklingError(LaunchError):
    """The function or one of its arguments cannot be serialized for spawned workers.

    Attributes:
        object_path: where the unpicklable object was found (``"args[1]"``, ``"train.__globals__['lock']"``).
        object_type: the type name of the unpicklable object.
    """

    def __init__(self, msg: str, *, object_path: str, object_type: str) -> None:
        super().__init__(msg)
        self.object_path = object_path
        self.object_type = object_type


class WorkerFailedError(LaunchError):
    """One or more workers of a launch failed: the family every worker failure belongs to.

    Catch this to handle any failed launch, on one machine or several. When the root-cause
    worker raised an ``Exception`` (of any type, ``RuntimeError`` and ``Exception`` included), the
    error raised in the caller is an instance of *both* its own type and this class (``except
    KeyError`` and ``except WorkerFailedError`` both catch it); a plain ``WorkerFailedError`` means
    its exception could not be rebuilt here (the message says why) or was a ``SystemExit`` /
    ``KeyboardInterrupt`` of the rank's own, and :class:`ProcessExitedError` that it exited or was
    killed without raising one.

    Attributes:
        failures: every failed rank's :class:`~nbaccel.launch.failures.WorkerFailure`, root cause first.
    """

    failures: tuple = ()
    name = "nbaccel launch"  # torch elastic's ChildFailedError.name: what failed

    def __new__(cls, *args: object, **kwargs: object) -> WorkerFailedError:
        # Accelerate's notebook_launcher raises torch elastic's ChildFailedError, so code written
        # for it catches that; every instance is made one too (a subclass joined at first use,
        # so importing nbaccel.errors never imports torch)
        return super().__new__(_child_failed_type(cls), *args)

    def __init__(self, *args: object, failures: tuple = ()) -> None:
        # *args: the user's exception type may sit before this class in a re-raised error's MRO
        # and pass its own arguments up through super().__init__.
        super().__init__(*args)
        if failures:
            self.failures = tuple(failures)

    @property
    def root_cause(self):  # noqa: ANN201 - a WorkerFailure | None: naming it would import launch/ here
        """The earliest failure (the first of :attr:`failures`)."""
        return self.failures[0] if self.failures else None

    @property
    def launch_failures(self) -> tuple:
        """The same as :attr:`failures` (the name nbaccel used first)."""
        return self.failures

    def get_first_failure(self) -> tuple:
        """ChildFailedError's ``(rank, failure)`` of the root cause, here a ``WorkerFailure``."""
        root = self.root_cause
        return (getattr(root, "rank", -1), root)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """ChildFailedError's report: here the error's own message."""
        return str(self)


def child_failed_bases() -> tuple[type[BaseException], ...]:
    """``(ChildFailedError,)`` from torch elastic, or ``()`` where it cannot be imported.

    Example:
        >>> [c.__name__ for c in child_failed_bases()]
        ['ChildFailedError']
    """
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError:  # torch built without distributed support
        return ()
    return (ChildFailedError,)


_CHILD_FAILED: dict[type, type] = {}


def _child_failed_type(cls: type[WorkerFailedError]) -> type[WorkerFailedError]:
    """``cls`` joined with torch elastic's ChildFailedError (cached; ``cls`` where it already is one)."""
    bases = child_failed_bases()
    if not bases or issubclass(cls, bases) or cls in _CHILD_FAILED.values():
        return cls
    if cls not in _CHILD_FAILED:
        try:
            _CHILD_FAILED[cls] = type(cls.__name__, (cls, *bases), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__, "__reduce__": _reduce_as(cls)})
        except TypeError:  # a layout that cannot be joined: catchable as before
            _CHILD_FAILED[cls] = cls
    return _CHILD_FAILED[cls]


def _reduce_as(cls: type[BaseException]):  # noqa: ANN202 - a __reduce__ for the joined type
    def reduce(self: BaseException) -> str | tuple:
        reduced = cls.__reduce__(self)
        if reduced[0] is _rebuild_error:  # pickle under the importable class; rebuilt joined
            return (_rebuild_error, (cls, *reduced[1][1:]))
        return reduced
    return reduce


class ProcessExitedError(WorkerFailedError):
    """A worker exited (non-zero code or signal) without reporting an exception."""


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``, or the hang watchdog fired.

    Attributes:
        stacks: ``{rank: text}`` Python stacks dumped from the ranks still running.
        reason: ``"timeout"`` or ``"hang"``.
    """

    def __init__(self, msg: str, *, stacks: dict[int, str], reason: str) -> None:
        super().__init__(msg)
        self.stacks = stacks
        self.reason = reason


class WorkerPoolError(LaunchError):
    """A :class:`~nbaccel.WorkerPool` cannot run tasks: it was closed, or it is dead.

    Attributes:
        state: ``"closed"`` (``close()`` was called), ``"dead"`` (a worker died or had to be killed), or
            ``"not owned"`` (used from a forked child of the process that started the workers).
        reason: why, in one line (the dead worker's rank and exit, say).
    """

    def __init__(self, msg: str, *, state: str, reason: str) -> None:
        super().__init__(msg)
        self.state = state
        self.reason = reason


class MissingDependencyError(NbaccelError, ImportError):
    """An optional package that a setting needs is not installed.

    Attributes:
        package: the missing package's import name (``"deepspeed"``).
        needed_for: what asked for it (``"DeepSpeedPlugin"``).
        install: the command that installs it.
    """

    def __init__(self, msg: str, *, package: str, needed_for: str, install: str) -> None:
        super().__init__(msg)
        self.package = package
        self.needed_for = needed_for
        self.install = install


class DistributedOperationError(NbaccelError, RuntimeError):
    """A collective got inputs that do not match across processes (checked in debug mode).

    Attributes:
        operation: the collective (``"gather"``, ``"broadcast"``, ...).
        shapes: ``{rank: shape}`` of what each process passed.
    """

    def __init__(self, msg: str, *, operation: str, shapes: dict[int, object]) -> None:
        super().__init__(msg)
        self.operation = operation
        self.shapes = shapes


class DeviceMapError(ConfigError):
    """A device map names an unknown module or device, or leaves part of the model unplaced.

    Attributes (besides :class:`ConfigError`'s): ``key`` is the module name at fault and
    ``value`` the device it was given.
    """


class CheckpointError(NbaccelError, ValueError):
    """A checkpoint file cannot be read: missing, truncated, corrupt or of an unknown format.

    Attributes:
        path: the file (or folder) at fault.
        key: the tensor name at fault, when one is known.
    """

    def __init__(self, msg: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(msg)
        self.path = path
        self.key = key


class UnsafeCheckpointError(CheckpointError):
    """A pickle checkpoint holds objects that would run code when loaded; it was not loaded."""


class CheckpointMismatchError(CheckpointError, RuntimeError):
    """The checkpoint and the model disagree; the model was left unchanged.

    A ``ValueError`` (Accelerate raises one for a shape mismatch) and a ``RuntimeError``
    (Accelerate's strict load raises torch's ``RuntimeError`` for unexpected keys).

    Attributes:
        missing_keys: model tensors the checkpoint does not hold.
        unexpected_keys: checkpoint tensors the model does not have.
        mismatched_shapes: ``{name: (checkpoint_shape, model_shape)}``.
    """

    def __init__(self, msg: str, *, path: str | None = None, missing_keys: tuple[str, ...] = (),
                 unexpected_keys: tuple[str, ...] = (),
                 mismatched_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
                 ) -> None:
        super().__init__(msg, path=path)
        self.missing_keys = tuple(missing_keys)
        self.unexpected_keys = tuple(unexpected_keys)
        self.mismatched_shapes = dict(mismatched_shapes or {})


class CheckpointDiskFullError(CheckpointError):
    """``save_state`` could not finish: the disk is full. Its partial copy was removed; the previous
    checkpoint (if any) is intact, so saving again once space is freed works.

    Attributes:
        path: the checkpoint folder being written.
        bytes_needed: about how many bytes the checkpoint takes (the previous one's size, or at
            least what was written before the disk filled).
        bytes_free: the bytes free on its filesystem once the partial copy was removed.
    """

    def __init__(self, msg: str, *, path: str, bytes_needed: int, bytes_free: int) -> None:
        super().__init__(msg, path=path)
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free


DistributedOperationException = DistributedOperationError
"""Accelerate's name for :class:`DistributedOperationError` (the same class)."""
