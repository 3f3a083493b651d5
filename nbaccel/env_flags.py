"""Accelerate's readers of environment flags, under their names: ``str_to_bool``,
``parse_flag_from_env``, ``parse_choice_from_env`` and ``get_int_from_env``.

They are public in ``accelerate.utils`` (and so in :mod:`nbaccel.utils`) for scripts moved over by
changing the import. nbaccel reads its own settings strictly, through :mod:`nbaccel.environment`
(a bad value is a ``ConfigError`` there); these keep Accelerate's looser meaning.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["get_int_from_env", "parse_choice_from_env", "parse_flag_from_env", "str_to_bool"]


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Accelerate's ``str_to_bool``: ``"yes"``/``"true"``/``"on"``/``"1"``... -> 1, negatives -> 0 (or bools).

    Raises:
        ValueError: any other text, as in Accelerate.

    Example:
        >>> str_to_bool("Yes"), str_to_bool("off", to_bool=True)
        (1, False)
    """
    value = value.lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}; use one of yes/no, true/false, on/off, 1/0")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The environment variable ``key`` read as a yes/no flag (``default`` when unset)."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The environment variable ``key`` as it is (``default`` when unset)."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: Sequence[str], default: int) -> int:
    """The first of ``env_keys`` set to an int >= 0 (``default`` when none is), as Accelerate reads ranks."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default
