"""Sizes written by people (``"10GB"``, ``"512MiB"``) read as bytes, with Accelerate's meaning.

The one parser for every size nbaccel accepts: ``max_memory`` budgets, ``max_shard_size``.
It reads exactly what Accelerate's ``convert_file_size_to_int`` reads, to the same number:
``KB``/``MB``/``GB`` are powers of 1000 and ``KiB``/``MiB``/``GiB`` powers of 1024 (any case),
a lower-case final ``b`` after a decimal unit means bits (``"8Mb"`` is 1 MB), and a plain
number needs a unit (``"100"`` is refused; the int ``100`` is 100 bytes).
"""

from __future__ import annotations

import math

from nbaccel.errors import ConfigError

__all__ = ["SIZE_UNITS", "convert_bytes", "convert_file_size_to_int"]

SIZE_UNITS: dict[str, int] = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_UNIT_NAMES = ("KB", "MB", "GB", "KiB", "MiB", "GiB")


def convert_file_size_to_int(size: int | str, *, key: str = "size") -> int:
    """Bytes in ``size``: an int (bytes, >= 0) or a number with a unit, such as ``"5GB"`` or ``"512MiB"``.

    Args:
        size: the size.
        key: the setting it came from, named in the error (``"max_memory"``, ``"max_shard_size"``).

    Raises:
        ConfigError: ``size`` is negative, has no unit or an unknown one, or is not an int or str.

    Example:
        >>> convert_file_size_to_int("1MiB"), convert_file_size_to_int("5GB"), convert_file_size_to_int("8Mb")
        (1048576, 5000000000, 1000000)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size >= 0:
            return size
    elif isinstance(size, str):
        upper = size.upper()
        unit = next((u for u in SIZE_UNITS if upper.endswith(u)), None)
        if unit is not None:
            try:
                number = float(size[: -len(unit)])
            except ValueError:
                number = math.nan
            if math.isfinite(number) and number >= 0:
                value = int(number * SIZE_UNITS[unit])
                bits = "I" not in unit and size.endswith("b")
                return value // 8 if bits else value
    raise ConfigError(
        f"`{key}` must be an int of bytes (>= 0) or a number with a unit, one of {list(_UNIT_NAMES)} "
        f"(got {size!r} of type {type(size).__name__}). Fix: write it like '10GB' or '512MiB'.",
        key=key, value=size, valid=f"an int >= 0, or '<number><unit>' with a unit in {list(_UNIT_NAMES)}")


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit under 1024 of it, as Accelerate prints sizes.

    Example:
        >>> convert_bytes(1536), convert_bytes(3 * 1024**3)
        ('1.5 KB', '3.0 GB')
    """
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"
