"""`DistributedType`: the one name for the kind of job, used by configs, worker settings and the Accelerator.

Accelerate's ``DistributedType``, as a ``str`` enum, so a config file's ``distributed_type:
MULTI_CPU`` and ``DistributedType.MULTI_CPU`` are the same value everywhere.
"""

from __future__ import annotations

import enum

from nbaccel.errors import ConfigError

__all__ = ["DistributedType", "as_distributed_type"]


class DistributedType(str, enum.Enum):
    """How the job is distributed: Accelerate's ``DistributedType``, as a ``str`` enum.

    Members equal their names as plain strings (``DistributedType.MULTI_CPU == "MULTI_CPU"``),
    and ``str()`` / f-strings give that string, so code comparing with strings keeps working.
    The values are the ones a launch config's ``distributed_type`` accepts.

    Example:
        >>> DistributedType.MULTI_CPU == "MULTI_CPU", f"{DistributedType.NO}"
        (True, 'NO')
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


def as_distributed_type(value: object, *, key: str = "distributed_type") -> DistributedType:
    """``value`` (a member or its name) as a :class:`DistributedType`.

    Args:
        value: the value given.
        key: the setting it came from, named in the error.

    Raises:
        ConfigError: ``value`` names no kind of job.

    Example:
        >>> as_distributed_type("FSDP") is DistributedType.FSDP
        True
    """
    try:
        return DistributedType(value)
    except ValueError:
        valid = tuple(t.value for t in DistributedType)
        raise ConfigError(f"`{key}` must be one of {list(valid)} (got {value!r}). Fix: set {key} to one of those.",
                          key=key, value=value, valid=valid) from None
