"""The ``nbaccel`` command: parses the command line and turns every error into one clear line.

``nbaccel config | env | launch | test``; each subcommand lives in its own module and registers
itself here. A mistake (a bad flag, an invalid config file, a missing script) prints one
``nbaccel <command>: error: ...`` line on stderr and exits with code 2; a failed run exits 1 (or
the failing worker's code); an interrupt exits 130. No traceback reaches the user except a
worker's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from nbaccel.cli.usage import UsageError
from nbaccel.errors import ConfigError, NbaccelError
from nbaccel.version import __version__

__all__ = ["UsageError", "build_parser", "main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)", prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    """The full ``nbaccel`` parser, with every subcommand registered."""
    from nbaccel.cli import config_cmd, env_cmd, launch_cmd, test_cmd

    parser = _Parser(prog="nbaccel", description="Distributed PyTorch from a notebook or a terminal: "
                     "write a launch config, report the environment, launch a script, check the setup.")
    parser.add_argument("--version", action="store_true", help="print nbaccel's version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="{config,env,launch,test}", parser_class=_Parser)
    for module in (config_cmd, env_cmd, launch_cmd, test_cmd):
        module.register(subparsers)
    return parser


def _prog(argv: Sequence[str]) -> str:
    command = next((a for a in argv if not a.startswith("-")), None)
    return f"nbaccel {command}" if command in ("config", "env", "launch", "test") else "nbaccel"


def _fail(prog: str, message: str, code: int) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nbaccel`` command line; returns the exit code.

    Args:
        argv: the arguments after ``nbaccel``; default ``sys.argv[1:]``.

    Returns:
        0 on success, 2 for a usage or config mistake, 130 when interrupted, else the
        command's failure code.

    Example:
        >>> main(["config", "--default", "--config_file", "/tmp/nbaccel.yaml"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog(argv)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as stop:  # --help, or argparse's own exit
            return stop.code if isinstance(stop.code, int) else 0
        if args.version:
            print(f"nbaccel {__version__}")
            return 0
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(args.func(args) or 0)
    except UsageError as exc:
        return _fail(exc.prog, str(exc), EXIT_USAGE)
    except ConfigError as exc:
        return _fail(prog, str(exc), EXIT_USAGE)
    except NbaccelError as exc:
        return _fail(prog, str(exc), 1)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # `nbaccel env | head`
        return 1


if __name__ == "__main__":
    sys.exit(main())
