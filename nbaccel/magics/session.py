"""Session defaults: the values "Use for this session" makes the defaults of later launches.

They form one precedence layer between the config file and a cell's flags:
file < session < flags < explicit arguments. They live on a :class:`SessionDefaults` object
owned by the loaded magics (one per IPython shell), never in the environment or on disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbaccel.config import LaunchConfig

__all__ = ["SessionDefaults"]


class SessionDefaults:
    """The launch settings chosen for this session, applied over the config file.

    Example:
        >>> session = SessionDefaults()
        >>> session.set({"num_processes": 3})
        >>> session.apply(LaunchConfig()).num_processes
        3
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    @property
    def values(self) -> dict[str, Any]:
        """A copy of the session's ``{field: value}`` overrides."""
        return dict(self._values)

    def set(self, values: Mapping[str, Any]) -> None:
        """Replace the session's overrides; every value is validated against ``LaunchConfig``.

        Raises:
            ConfigError: a key is not a ``LaunchConfig`` field or a value is invalid.
        """
        LaunchConfig().with_overrides(**values)
        self._values = dict(values)

    def clear(self) -> None:
        """Forget the session's overrides; later launches use the config file alone."""
        self._values = {}

    def apply(self, config: LaunchConfig) -> LaunchConfig:
        """``config`` with the session's overrides applied (one precedence layer).

        Raises:
            ConfigError: the overrides and ``config`` together form an impossible combination.
        """
        return config.with_overrides(**self._values)

    def __bool__(self) -> bool:
        return bool(self._values)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(self._values.items()))
        return f"SessionDefaults({shown})"
