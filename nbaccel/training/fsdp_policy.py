"""FSDP2 mixed precision policies built from what users write: a policy, a precision name, or a dict.

Kept apart from :mod:`nbaccel.training.fsdp` so that the plugin (:mod:`nbaccel.training.plugins`), which checks
its policy when it is made, and the sharding code both use it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from nbaccel.errors import ConfigError

__all__ = ["POLICY_DTYPES", "make_mixed_precision_policy"]

# Names a policy's dtypes may be given by (Accelerate's `mixed_precision` names).
POLICY_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_mixed_precision_policy(value: Any) -> Any:
    """A ``torch.distributed.fsdp.MixedPrecisionPolicy`` from a policy, a precision name, or a dict of its fields.

    A name (``"bf16"``, ``"fp16"``, ``"fp32"``) sets ``param_dtype`` and ``reduce_dtype``, as
    Accelerate does for FSDP2. In a dict, dtypes may be given as ``torch.dtype`` or as names.

    Args:
        value: a ``MixedPrecisionPolicy``, a name, a mapping of ``MixedPrecisionPolicy`` fields, or ``None``.

    Returns:
        The policy (``None`` for ``None``).

    Raises:
        ConfigError: an unknown name, an unknown field, or a value of another type.

    Example:
        >>> make_mixed_precision_policy("bf16").param_dtype
        torch.bfloat16
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        dtype = _policy_dtype("mixed_precision_policy", value)
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if isinstance(value, Mapping):
        fields = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(f"`mixed_precision_policy` has unknown keys {unknown}; valid keys: {fields}. "
                              "Fix: drop them (`buffer_dtype` is FSDP1's)", key="mixed_precision_policy",
                              value=unknown, valid=fields)
        kwargs: dict[str, Any] = {k: _policy_dtype(k, v) if isinstance(v, str) else v for k, v in value.items()}
        return MixedPrecisionPolicy(**kwargs)
    raise ConfigError(f"`mixed_precision_policy` must be a torch.distributed.fsdp.MixedPrecisionPolicy, one of "
                      f"{list(POLICY_DTYPES)} or a dict of its fields (got {type(value).__name__}: {value!r}); "
                      "for example mixed_precision_policy='bf16'", key="mixed_precision_policy", value=value,
                      valid=list(POLICY_DTYPES))


def _policy_dtype(key: str, name: str) -> torch.dtype:
    if name not in POLICY_DTYPES:
        raise ConfigError(f"`{key}` must be one of {list(POLICY_DTYPES)} (got {name!r}); for example 'bf16'",
                          key=key, value=name, valid=list(POLICY_DTYPES))
    return POLICY_DTYPES[name]
