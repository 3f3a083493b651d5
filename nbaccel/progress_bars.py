"""`tqdm`: a progress bar drawn by each machine's first process only, the others' bars disabled.

The bar is tqdm's own (``tqdm.auto``: a widget in a notebook, text elsewhere; inside a launch,
workers' bars are text that reaches the cell's panel). ``tqdm`` is an optional dependency.
"""

from __future__ import annotations

from typing import Any

from nbaccel.errors import ConfigError, MissingDependencyError

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but local rank 0 by default.

    Args:
        *args: tqdm's positional arguments (the iterable first).
        main_process_only: draw only on each machine's main process.
        **kwargs: tqdm's keyword arguments; ``disable=True`` disables it everywhere.

    Raises:
        ConfigError: a bool as the first argument (Accelerate's old ``tqdm(main_process_only, ...)``).
        MissingDependencyError: tqdm is not installed.

    Example:
        >>> sum(tqdm(range(3), disable=True))
        3
    """
    try:
        from tqdm.auto import tqdm as tqdm_auto
    except ImportError:
        raise MissingDependencyError(
            "nbaccel's tqdm needs the tqdm package, which is not installed. Fix: pip install tqdm",
            package="tqdm", needed_for="tqdm", install="pip install tqdm") from None
    if args and isinstance(args[0], bool):
        raise ConfigError(
            f"tqdm's first argument must be the iterable (got the bool {args[0]}); whether only the "
            "main process draws is the keyword main_process_only. Fix: tqdm(iterable, "
            f"main_process_only={args[0]})", key="args[0]", value=args[0], valid="an iterable")
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from nbaccel.partial_state import PartialState

        disable = PartialState().local_process_index != 0
    return tqdm_auto(*args, **kwargs, disable=disable)
