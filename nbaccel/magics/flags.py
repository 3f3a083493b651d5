"""Reading a magic's flags: a flag it does not take is a ``UsageError`` that names the flag meant.

``%%accel_launch --mixedprecision bf16`` says "did you mean --mixed_precision?"; a flag only
``nbaccel launch`` takes (``--gpu_ids``) says where that setting goes instead. The value types
(``--timeout``'s seconds, ``--ranks``' list, ``-o``'s names) refuse a bad value with the form it
should take.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, Literal, get_args

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

__all__ = ["STATUS_MODES", "StatusMode", "hang_timeout_seconds", "parse_flags", "parse_out_names",
           "positive_seconds", "rank_list"]

_CLOSE_ENOUGH = 0.75  # difflib ratio: --mixedprecision / --mixed_precision is 0.97, --cpu / --port 0.57


def parse_flags(magic: Any, line: str, name: str) -> argparse.Namespace:
    """Parse ``line`` with the ``magic_arguments`` parser of ``magic``, as ``parse_argstring`` does.

    Args:
        magic: the bound magic method (decorated with ``magic_arguments``).
        line: the magic's line.
        name: the magic as the user typed it (``"%%accel_launch"``), for the message.

    Raises:
        UsageError: a flag the magic does not take (with the closest one it does), or any other
            argument the magic's parser refuses.

    Example:
        >>> from nbaccel.magics.magics import AccelMagics
        >>> parse_flags(AccelMagics().accel_launch, "-n 2", "%%accel_launch").num_processes
        2
    """
    parser: argparse.ArgumentParser = magic.parser
    args, unknown = parser.parse_known_args(arg_split(line))
    if unknown:
        raise UsageError(_unknown_message(name, unknown, _flags(parser)))
    return args


def _unknown_message(name: str, unknown: list[str], known: list[str]) -> str:
    flag = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), None)
    if flag is None:
        return (f"{name}: unexpected arguments {' '.join(unknown)!r}. Fix: remove them; {name}? lists the "
                "flags it takes.")
    msg = f"{name}: no flag {flag}."
    close = difflib.get_close_matches(flag, known, n=1, cutoff=_CLOSE_ENOUGH)
    if close:
        return f"{msg} Fix: did you mean {close[0]}?"
    elsewhere = difflib.get_close_matches(flag, _cli_flags(), n=1, cutoff=_CLOSE_ENOUGH)
    if elsewhere:
        return (f"{msg} {elsewhere[0]} is a flag of `nbaccel launch`; {name} does not take it. Fix: set it in the "
                "config file (%accel_config), or pass one of the flags listed by "
                f"{name}?.")
    return f"{msg} Fix: use one of {', '.join(known)}."


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def _cli_flags() -> list[str]:
    from nbaccel.cli.launch_cmd import add_launch_flags

    parser = argparse.ArgumentParser(add_help=False)
    add_launch_flags(parser)
    return _flags(parser)


StatusMode = Literal["auto", "widget", "text", "none"]
STATUS_MODES = get_args(StatusMode)


def positive_seconds(text: str) -> float:
    """``--timeout``: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


def hang_timeout_seconds(text: str) -> float | None:
    """``--hang_timeout``: seconds above 0, or ``none`` / ``off`` for no limit."""
    return None if text.lower() in ("none", "off") else positive_seconds(text)


def rank_list(text: str) -> list[int]:
    """``--ranks``: rank numbers such as ``0`` or ``0,1``."""
    try:
        return [int(p) for p in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be rank numbers such as 0 or 0,1 (got {text!r})") from None


def parse_out_names(values: Sequence[str]) -> list[str]:
    """``-o``/``--out``: the variable names, split on commas and spaces."""
    names = [n for v in values for n in v.replace(",", " ").split()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"-o/--out takes variable names (got {bad[0]!r}). Fix: -o model,losses")
    return names
