"""Warm one-process ranks (stub)."""

from __future__ import annotations

from nbaccel.launch.request import LaunchRequest

__all__ = ["release_warm_devices"]


def release_warm_devices(request: LaunchRequest) -> None:
    """Close the warm rank if ``request`` needs its device."""
