"""`nbaccel launch`: run a script on N workers per machine, with the notebook's launcher.

Settings are layered: config file < SLURM's variables < flags. On one machine the same
supervisor as ``notebook_launcher`` starts the workers, each running the script as ``__main__``
with ``sys.argv`` set to the script and its arguments; across machines torch's elastic agent
takes over. A failing worker's traceback is printed (root cause first) and its failure sets the
exit code; Ctrl-C (or SIGTERM) stops every worker.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

from nbaccel.cli.slurm import read_slurm
from nbaccel.cli.usage import UsageError
from nbaccel.config import LaunchConfig, load_config
from nbaccel.environment import (
    MixedPrecision,
    apply_environment,
    single_process_environment,
)
from nbaccel.errors import ConfigError, NbaccelError, WorkerFailedError
from nbaccel.tracebacks import clean_traceback

__all__ = ["Terminated", "add_launch_flags", "launch_function", "register", "report_failure",
           "resolve_config", "run_script"]

_DEFAULT_MULTI_NODE_PORT = 29500
_FLAG_OF_KEY = {"use_cpu": "cpu"}


class Terminated(BaseException):
    """The launcher got SIGTERM (a scheduler stopping the job); the workers are stopped.

    Attributes:
        signum: the signal received.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


# ----------------------------------------------------------------------------- the worker side


def run_script(target: str, script_args: Sequence[str], as_module: bool = False) -> None:
    """Run ``target`` as ``__main__`` in this worker, as ``python target *script_args`` would.

    Args:
        target: a script path, or a module name when ``as_module``.
        script_args: what the script finds in ``sys.argv[1:]``.
        as_module: run ``python -m target`` instead of a file.
    """
    if "WORLD_SIZE" not in os.environ:
        apply_environment(single_process_environment())  # so a script's init_process_group() works
    sys.argv = [target, *script_args]
    if as_module:
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0:1] = [str(Path(target).resolve().parent)]
        runpy.run_path(target, run_name="__main__")


# ----------------------------------------------------------------------------- settings


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``launch`` and ``test`` (each overrides the config file)."""
    def flag(name: str, **kw: Any) -> None:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])  # --cpu once, not twice
        parser.add_argument(*spellings, dest=name, **kw)

    flag("config_file", default=None, metavar="PATH",
         help="config file (default: $NBACCEL_CONFIG_FILE or ~/.cache/nbaccel/default_config.yaml)")
    flag("num_processes", type=int, default=None, metavar="N", help="workers on this machine")
    flag("mixed_precision", choices=get_args(MixedPrecision), default=None, help="mixed precision for the workers")
    flag("cpu", action="store_true", default=None, help="run CPU workers even where GPUs exist")
    flag("gpu_ids", default=None, metavar="IDS", help="GPUs to use: 'all' or a list like '0,1'")
    flag("num_machines", type=int, default=None, metavar="N", help="machines taking part")
    flag("machine_rank", type=int, default=None, metavar="R", help="this machine's index (0 is the main one)")
    flag("main_process_ip", default=None, metavar="ADDR", help="address of machine 0")
    flag("main_process_port", type=int, default=None, metavar="PORT", help="rendezvous port on machine 0")
    flag("rdzv_backend", choices=("static", "c10d"), default=None, help="multi-machine rendezvous backend")
    flag("start_method", choices=("fork", "spawn"), default=None, help="how workers start (default: fork when safe)")
    flag("timeout", type=float, default=None, metavar="SECONDS", help="stop the launch after this many seconds")


def _flag_error(exc: ConfigError, given: dict[str, Any]) -> ConfigError:
    flag = _FLAG_OF_KEY.get(exc.key or "", exc.key)
    if exc.key in given:
        return ConfigError(f"--{flag} {given[exc.key]!r}: {exc}", key=exc.key, value=exc.value, valid=exc.valid)
    return exc


def resolve_config(args: argparse.Namespace) -> tuple[LaunchConfig, str | None]:
    """The config in effect: file < SLURM < flags; also SLURM's one-line note, if any.

    Raises:
        ConfigError: the file, SLURM's variables or a flag holds an invalid value.
    """
    cfg = load_config(args.config_file)
    flags = {"num_processes": args.num_processes, "mixed_precision": args.mixed_precision, "use_cpu": args.cpu,
             "gpu_ids": args.gpu_ids, "num_machines": args.num_machines, "machine_rank": args.machine_rank,
             "main_process_ip": args.main_process_ip, "main_process_port": args.main_process_port,
             "rdzv_backend": args.rdzv_backend, "start_method": args.start_method, "timeout": args.timeout}
    given = {k: v for k, v in flags.items() if v is not None}
    slurm = read_slurm()
    note = None
    if slurm is not None:
        layer: dict[str, Any] = {"num_machines": slurm.num_nodes, "machine_rank": slurm.node_rank}
        if slurm.num_nodes > 1:
            layer.update(main_process_ip=slurm.main_host, main_process_port=cfg.main_process_port or slurm.port)
        cfg = LaunchConfig.from_mapping({**cfg.to_mapping(), **layer}, source="SLURM's variables")
        note = slurm.note
    try:
        cfg = cfg.with_overrides(**given)
    except ConfigError as exc:
        raise _flag_error(exc, given) from None
    return cfg, note


# ----------------------------------------------------------------------------- launching


@contextmanager
def _sigterm_stops_workers() -> Iterator[None]:
    """Turn SIGTERM into an exception, so the supervisor stops the workers before we exit."""
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_function(function: Callable[..., Any], args: Sequence[Any], cfg: LaunchConfig, *,
                    hang_timeout: float | None = None, return_all: bool = False, rdzv_id: str = "none",
                    warm_imports: bool | None = None) -> Any:
    """Run ``function(*args)`` as ``cfg`` says: this machine's supervisor, or elastic across machines."""
    from nbaccel.launch.registry import launch
    from nbaccel.launch.request import build_request

    if cfg.start_method != "spawn":
        import torch  # noqa: F401 - once here, so forked workers share it instead of importing it each

    port = cfg.main_process_port or (_DEFAULT_MULTI_NODE_PORT if cfg.num_machines > 1 else None)
    request = build_request(function, args, config=cfg, hang_timeout=None if cfg.num_machines > 1 else hang_timeout,
                            return_all=return_all, rdzv_id=rdzv_id, use_port=port, warm_imports=warm_imports,
                            fresh=True)  # a script runs once: nothing to keep warm
    with _sigterm_stops_workers():
        return launch(request)


def report_failure(exc: BaseException, prog: str, *, trim: bool = True) -> int | None:
    """Print a worker failure (root-cause traceback, then the report); its exit code, or ``None``.

    ``None`` means ``exc`` is not a worker failure and should propagate. ``trim`` drops the
    launcher's own frames from the traceback.
    """
    from nbaccel.launch.failures import format_report

    failures = exc.failures if isinstance(exc, WorkerFailedError) else getattr(exc, "failures", None)
    if not failures:
        return None
    root = failures[0]
    if root.traceback and root.exc_type != "SystemExit":
        shown = clean_traceback(root.traceback) if trim else root.traceback
        sys.stderr.write(f"{prog}: traceback of rank {root.rank} (the root cause):\n{shown.rstrip()}\n")
    sys.stderr.write(f"{prog}: error: {format_report(failures)}\n")
    sys.stderr.flush()
    if root.exc_type == "KeyboardInterrupt":
        return 130
    if root.signal is not None:
        return 128 + root.signal
    return root.exitcode if root.exitcode else 1


def _script_builds_ddp(args: argparse.Namespace) -> bool:
    """Whether the script looks like it builds a DDP model (then the launcher imports what DDP needs once)."""
    from nbaccel.launch.warmup import may_build_ddp, source_names

    if args.module:
        spec = importlib.util.find_spec(args.script)
        origin = spec.origin if spec is not None else None
    else:
        origin = args.script
    try:
        return may_build_ddp(names=source_names(Path(origin).read_text())) if origin else False
    except (OSError, UnicodeDecodeError):
        return False


def _check_target(args: argparse.Namespace) -> None:
    if args.module:
        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"module {args.script!r} cannot be found from {os.getcwd()!r}. Fix: check its name, "
                             "or run from the folder that holds it.", prog="nbaccel launch")
        return
    path = Path(args.script)
    if not path.is_file():
        what = "is a directory, not a script" if path.is_dir() else "does not exist"
        raise UsageError(f"script {args.script!r} {what}. Fix: pass the path of a Python file, e.g. "
                         "`nbaccel launch train.py`.", prog="nbaccel launch")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel launch`` to the command line."""
    parser = subparsers.add_parser(
        "launch", help="run a script on N workers (per machine)",
        description="Run a script on N worker processes per machine. Flags override the config file; "
                    "everything after the script goes to the script.")
    add_launch_flags(parser)
    parser.add_argument("--hang_timeout", "--hang-timeout", dest="hang_timeout", type=float, default=None,
                        metavar="SECONDS", help="after some workers exit, stop the rest when they print nothing "
                        "for this long, showing their stacks (default: off)")
    parser.add_argument("--dry_run", "--dry-run", dest="dry_run", action="store_true",
                        help="print the settings in effect and exit without launching")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("script", help="the script (or, with -m, the module) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=run)


def _dry_run(cfg: LaunchConfig, args: argparse.Namespace) -> int:
    import yaml

    command = f"{'-m ' if args.module else ''}{args.script} {' '.join(args.script_args)}"
    print(f"nbaccel launch (dry run): {command}".rstrip())
    sys.stdout.write(yaml.safe_dump(cfg.to_mapping(), sort_keys=True))
    return 0


def run(args: argparse.Namespace) -> int:
    """Launch the script; 0 when every worker succeeded."""
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise UsageError(f"--hang_timeout must be a positive number of seconds (got {args.hang_timeout:g})",
                         prog="nbaccel launch")
    cfg, note = resolve_config(args)
    if note:
        print(note, file=sys.stderr, flush=True)
    if args.dry_run:
        return _dry_run(cfg, args)
    _check_target(args)
    try:
        launch_function(run_script, (args.script, list(args.script_args), args.module), cfg,
                        hang_timeout=args.hang_timeout, rdzv_id=os.environ.get("SLURM_JOB_ID", "none"),
                        warm_imports=_script_builds_ddp(args))
    except Terminated as exc:
        print(f"nbaccel launch: {exc}; every worker was stopped", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except KeyboardInterrupt as exc:
        if getattr(exc, "failures", None):
            return report_failure(exc, "nbaccel launch") or 130
        print("nbaccel launch: interrupted; every worker was stopped", file=sys.stderr, flush=True)
        return 130
    except NbaccelError as exc:
        code = report_failure(exc, "nbaccel launch")
        if code is None:
            raise
        return code
    except BaseException as exc:  # a worker's own exception type, re-raised here
        code = report_failure(exc, "nbaccel launch")
        if code is None:
            sigval = getattr(exc, "sigval", None)  # torch elastic's SignalException
            if sigval is not None:
                print(f"nbaccel launch: stopped by signal {sigval}", file=sys.stderr, flush=True)
                return 128 + int(sigval)
            raise
        return code
    return 0
