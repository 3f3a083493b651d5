"""What trackers accept as a logged value: numbers and strings, with tensors and numpy scalars unwrapped."""

from __future__ import annotations

from typing import Any

__all__ = ["scalar_or_text"]


def scalar_or_text(value: Any) -> Any:
    """``value`` as a plain ``int``/``float``/``bool``/``str`` where it is one (a one-element tensor or
    numpy scalar becomes a Python number); anything else comes back unchanged.

    Example:
        >>> import torch
        >>> scalar_or_text(torch.tensor(0.5)), scalar_or_text("ok"), scalar_or_text(3)
        (0.5, 'ok', 3)
    """
    if isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    if callable(item):  # torch tensors and numpy values; .item() refuses more than one element
        try:
            return item()
        except (ValueError, RuntimeError):
            return value
    return value
