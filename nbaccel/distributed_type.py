"""`DistributedType`: the one name for the kind of job, used by configs, worker settings and the Accelerator.

Accelerate's ``DistributedType``, as a ``str`` enum, so a config file's ``distributed_type:
MULTI_CPU`` and ``DistributedType.MULTI_CPU`` are the same value everywhere.
"""

from __future__ import annotations

import enum

from nbaccel.errors import ConfigError

__all__ = ["LAUNCHABLE_TYPES", "DistributedType", "as_distributed_type"]


class DistributedType(str, enum.Enum):
    """How the job is distributed: Accelerate's ``DistributedType``, as a ``str`` enum.

    Members equal their names as plain strings (``DistributedType.MULTI_CPU == "MULTI_CPU"``),
    and ``str()`` / f-strings give that string, so code comparing with strings keeps working.
    It has all of Accelerate's members, so code that names other hardware in tuples
    (``state.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_NPU)``) runs;
    a launch config accepts only :data:`LAUNCHABLE_TYPES` (nbaccel has no engine for NPU, MLU,
    SDAA, MUSA, XPU, HPU, Neuron or Megatron-LM jobs), so a state never holds the others.

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
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


LAUNCHABLE_TYPES: tuple[DistributedType, ...] = (DistributedType.NO, DistributedType.MULTI_CPU,
                                                 DistributedType.MULTI_GPU,
                                                 DistributedType.XLA, DistributedType.FSDP, DistributedType.DEEPSPEED)
"""The kinds of job nbaccel can launch and run; the other members name hardware it has no engine for."""


def as_distributed_type(value: object, *, key: str = "distributed_type") -> DistributedType:
    """``value`` (a member or its name) as a :class:`DistributedType`.

    Args:
        value: the value given.
        key: the setting it came from, named in the error.

    Raises:
        ConfigError: ``value`` names no kind of job, or one nbaccel cannot run (not in
            :data:`LAUNCHABLE_TYPES`).

    Example:
        >>> as_distributed_type("FSDP") is DistributedType.FSDP
        True
    """
    valid = tuple(t.value for t in LAUNCHABLE_TYPES)
    try:
        kind = DistributedType(value)
    except ValueError:
        raise ConfigError(f"`{key}` must be one of {list(valid)} (got {value!r}). Fix: set {key} to one of those.",
                          key=key, value=value, valid=valid) from None
    if kind not in LAUNCHABLE_TYPES:
        raise ConfigError(f"`{key}` {kind.value!r} names hardware nbaccel has no engine for; it runs {list(valid)}. "
                          f"Fix: set {key} to one of those (MULTI_GPU for CUDA GPUs, MULTI_CPU for CPU processes).",
                          key=key, value=value, valid=valid)
    return kind
