"""Accelerate's ``prepare_data_loader`` options, given one by one, as a :class:`DataLoaderConfiguration`.

Accelerate's ``prepare_data_loader`` takes ``split_batches=``, ``even_batches=``, ... as separate
arguments; nbaccel keeps them on one validated configuration. This module turns the first into
the second and refuses what nbaccel has no counterpart for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nbaccel.errors import ConfigError
from nbaccel.training.plugins import DataLoaderConfiguration

__all__ = ["UNSUPPORTED_OPTIONS", "config_from_options"]

UNSUPPORTED_OPTIONS: dict[str, str] = {
    "rng_types": "prepared loaders keep their ranks' shuffles in step through a shared generator; drop rng_types",
    "slice_fn_for_dispatch": "dispatched batches are sliced along the first dimension; slice the batch in your loop",
    "torch_device_mesh": "tensor / context parallel meshes are not supported; drop torch_device_mesh",
}
"""Accelerate options accepted only at their default (``None``), with the fix when another value is given."""


def config_from_options(config: DataLoaderConfiguration | None, options: Mapping[str, Any]) -> DataLoaderConfiguration:
    """``config``, or one built from Accelerate's separate options (never both).

    Args:
        config: a configuration, or ``None``.
        options: Accelerate's keyword arguments (``split_batches=True``, ...).

    Raises:
        ConfigError: an unknown option, an option also set by ``config``, or a value nbaccel
            does not support.

    Example:
        >>> config_from_options(None, {"even_batches": False}).even_batches
        False
    """
    fields = {f.name for f in dataclasses.fields(DataLoaderConfiguration)}
    for key, value in options.items():
        if key in UNSUPPORTED_OPTIONS:
            if value is not None:
                raise ConfigError(f"`{key}` is not supported by nbaccel (got {value!r}): {UNSUPPORTED_OPTIONS[key]}.",
                                  key=key, value=value, valid=(None,))
        elif key not in fields:
            valid = sorted(fields | set(UNSUPPORTED_OPTIONS))
            raise ConfigError(f"prepare_data_loader got an unknown option `{key}`; valid: {valid}. Fix: remove it "
                              "or correct its name.", key=key, value=value, valid=valid)
    given = {k: v for k, v in options.items() if k in fields}
    if config is not None and given:
        raise ConfigError(f"prepare_data_loader got both `config=` and {sorted(given)}; pass the options one way. "
                          "Fix: drop config=, or set them on the DataLoaderConfiguration.",
                          key=sorted(given)[0], value=given[sorted(given)[0]], valid="either config= or the options")
    return config if config is not None else DataLoaderConfiguration(**given)
