"""Reading a progress bar's text: how far a rank's tqdm bar (or any ``NN%`` bar) has got.

Workers' progress bars reach the launching process as text redrawn with ``\\r`` (see
:class:`~nbaccel.launch.output.OutputRelay`); the status panel shows each rank's latest one as a
bar of its own instead of lines redrawn over each other.
"""

from __future__ import annotations

import re

__all__ = ["progress_fraction"]

_PERCENT = re.compile(r"(\d{1,3})%")
_COUNT = re.compile(r"(\d+)/(\d+)")


def progress_fraction(text: str) -> float | None:
    """How far the bar in ``text`` is, from 0 to 1 (``None`` when it shows no fraction).

    Example:
        >>> progress_fraction("epoch 1:  45%|####5     | 45/100 [00:01<00:02, 30.1it/s]")
        0.45
        >>> progress_fraction("batches 3/12"), progress_fraction("loading...")
        (0.25, None)
    """
    counted = _COUNT.search(text)
    if counted is not None and int(counted.group(2)) > 0:
        return min(1.0, int(counted.group(1)) / int(counted.group(2)))
    percent = _PERCENT.search(text)
    return min(1.0, int(percent.group(1)) / 100) if percent is not None else None
