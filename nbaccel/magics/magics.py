"""The ``%%accel_launch``, ``%accel_workers``, ``%accel_config`` and ``%accel_env`` magics: one ``Magics`` class.

``%%accel_launch`` runs its cell on N workers through :func:`nbaccel.notebook_launcher`: the
settings are layered config file < session defaults (``%accel_config``'s "Use for this session")
< the cell's flags; a bad flag is a ``UsageError`` and nothing starts; the last expression of
rank 0 is the cell's value and ``-o`` names come back into the notebook; a worker's failure is
shown as that rank's traceback through the cell's own lines. ``%%accel_launch --persist`` runs the
cell on the warm workers ``%accel_workers start`` started (:mod:`nbaccel.magics.workers`), in a
namespace per rank that lasts between cells (:mod:`nbaccel.magics.persist`).
"""

from __future__ import annotations

import argparse
import linecache
from collections.abc import Callable, Sequence
from typing import Any, cast, get_args

from IPython.core.displayhook import DisplayHook
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbaccel.config import LaunchBackend, LaunchConfig, StartMethod, load_config
from nbaccel.environment import MixedPrecision, config_file_path
from nbaccel.errors import (
    ConfigError,
    EnvironmentStateError,
    MissingDependencyError,
    PayloadPicklingError,
    WorkerFailedError,
)
from nbaccel.hardware import in_colab, in_notebook
from nbaccel.launch.request import LaunchRequest
from nbaccel.magics.cell import CellProgram, CellResult, LinecacheEntry, run_cell_program
from nbaccel.magics.flags import (
    STATUS_MODES,
    StatusMode,
    hang_timeout_seconds,
    parse_flags,
    parse_out_names,
    positive_seconds,
    rank_list,
)
from nbaccel.magics.render import attach_renderer, render_interrupt
from nbaccel.magics.session import SessionDefaults
from nbaccel.magics.workers import NotebookPool, plain_interrupt

__all__ = ["AccelMagics"]

def _usage(exc: Exception) -> UsageError:
    return UsageError(f"%%accel_launch: {exc}")


@magics_class
class AccelMagics(Magics):
    """nbaccel's magics; ``%load_ext nbaccel`` registers one instance per shell.

    Attributes:
        session: the "Use for this session" defaults applied to every ``%%accel_launch``.
    """

    def __init__(self, shell: Any = None) -> None:
        super().__init__(shell)
        self.session = SessionDefaults()
        self.workers = NotebookPool()

    # ------------------------------------------------------------------ %%accel_launch
    @magic_arguments()
    @argument("-n", "--num_processes", type=int, default=None,
              help="workers on this machine (default: the config's, else one per GPU or up to 4 CPUs)")
    @argument("--mixed_precision", choices=get_args(MixedPrecision), default=None,
              help="mixed precision the workers' Accelerator uses")
    @argument("--cpu", action=argparse.BooleanOptionalAction, default=None,
              help="run on CPU processes even where GPUs exist (--no-cpu overrides a config's use_cpu)")
    @argument("--config_file", default=None, help="config file to read instead of the default one")
    @argument("--start_method", choices=get_args(StartMethod), default=None,
              help="how workers start (default: fork when safe, else spawn)")
    @argument("--timeout", type=positive_seconds, default=None, help="stop the launch after this many seconds")
    @argument("--hang_timeout", type=hang_timeout_seconds, default=120.0,
              help="stop ranks silent this long after others finished ('none' to disable; default 120)")
    @argument("--ranks", type=rank_list, default=None, help="show only these ranks' output and displays, e.g. 0 or 0,1 "
                   "(default: every rank's output, rank 0's displays)")
    @argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    @argument("--backend", choices=get_args(LaunchBackend), default=None,
              help="where the ranks run: this machine ('local') or a Ray cluster ('ray'); default: the config's")
    @argument("--ray_address", default=None,
              help="with --backend ray: the cluster ('auto', 'ray://host:10001'; default: this kernel's "
                   "connection, else a new local instance)")
    @argument("--num_nodes", type=int, default=None, help="machines taking part (multi-node)")
    @argument("--node_rank", type=int, default=None, help="this machine's rank (multi-node)")
    @argument("--rdzv_endpoint", default="", help="host:port of the rendezvous (multi-node)")
    @argument("-o", "--out", nargs="+", default=(), metavar="NAME",
              help="names to set in the notebook after the run, from rank 0 (see --all-ranks)")
    @argument("--all-ranks", "--all_ranks", dest="all_ranks", action="store_true",
              help="set each -o name to a {rank: value} dict from every rank")
    @argument("--status", choices=STATUS_MODES, default="auto",
              help="live status panel: a widget, plain text at the end, or none (default: auto)")
    @argument("--persist", action="store_true",
              help="run on the warm workers of %%accel_workers start, in a namespace per rank that lasts between cells")
    @argument("--fresh", action="store_true",
              help="one process: start a new worker instead of the rank kept warm for this kernel")
    @argument("--background", nargs="?", const=True, default=False, metavar="NAME",
              help="return at once with the run's handle (set as NAME if given) and show it live; other "
                   "cells run meanwhile. %%accel_runs lists runs")
    @cell_magic
    def accel_launch(self, line: str, cell: str) -> Any:
        """Run this cell on several worker processes, like ``notebook_launcher`` would run a function.

        The cell runs in every worker, in a namespace seeded from the notebook's: the notebook's
        own names under fork; under spawn, the names the cell uses, sent by value. Rank 0's last
        expression is the cell's value. Options mirror ``notebook_launcher``.

        Example::

            %%accel_launch -n 2 -o losses
            from nbaccel import Accelerator
            accelerator = Accelerator()
            losses = train(accelerator)
            accelerator.num_processes
        """
        args = parse_flags(self.accel_launch, line, "%%accel_launch")
        out_names = parse_out_names(args.out)
        if isinstance(args.background, str) and not args.background.isidentifier():
            raise UsageError(f"%%accel_launch: --background takes a variable name for the run (got "
                             f"{args.background!r}). Fix: --background run, or --background alone.")
        if args.persist:
            return self._persisted(line, cell, args, out_names)
        config = self._config(args)
        program = self._program(line, cell, out_names, args.all_ranks)
        request = self._request(program, config, args)  # also fails early on what this machine cannot run
        if args.background:
            return self._in_background(request, None, args, out_names, cell)
        request = request.with_observer(self._observer(args.status, request))
        results = self._recorded(request, None)
        return self._finish(results, out_names, args.all_ranks, cell)

    def _persisted(self, line: str, cell: str, args: argparse.Namespace, out_names: Sequence[str]) -> Any:
        from nbaccel.magics.persist import PersistentCellProgram
        from nbaccel.magics.workers import launch_flags_given, persisted_launch

        pool = self.workers.required("%%accel_launch --persist")
        given = launch_flags_given(args)
        if given:
            raise UsageError(f"%%accel_launch --persist runs on the workers started already, so --{given[0]} has no "
                             f"effect here. Fix: drop --{given[0]}, or pass it to %accel_workers start (or restart).")
        program = self._program(line, cell, out_names, args.all_ranks, kind=PersistentCellProgram)
        try:
            request = pool.request(run_cell_program, (program,), output_ranks=args.ranks, return_all=args.all_ranks)
        except ConfigError as exc:
            raise _usage(exc) from None
        if args.background:
            return self._in_background(request, persisted_launch(pool), args, out_names, cell, pool=pool)
        request = request.with_observer(self._observer(args.status, request))
        results = self._recorded(request, persisted_launch(pool))
        return self._finish(results, out_names, args.all_ranks, cell)

    def _recorded(self, request: LaunchRequest, launch: Callable[[LaunchRequest], Any] | None) -> Any:
        """The launch, recorded as a run of the kernel so ``%accel_runs show`` can show it again."""
        from nbaccel.runs.start import cell_label, launch_recorded

        return launch_recorded(request, lambda req: self._launch(req, launch), cell=cell_label("%%accel_launch"))

    def _in_background(self, request: LaunchRequest, launch: Callable[[LaunchRequest], Any] | None,
                       args: argparse.Namespace, out_names: Sequence[str], cell: str, pool: Any = None) -> Any:
        """Start the launch as a background run (:func:`nbaccel.magics.runs.start_cell_run`); its handle."""
        from nbaccel.magics.runs import start_cell_run

        def finish(req: LaunchRequest) -> Any:  # on the run's thread: -o names are set when it ends
            return self._finish(self._launch(req, launch), out_names, args.all_ranks, cell)

        return start_cell_run(self.shell, request, finish, name=args.background, show=args.status != "none", pool=pool)

    def _config(self, args: argparse.Namespace) -> LaunchConfig:
        endpoint_host, endpoint_port = None, None
        if getattr(args, "rdzv_endpoint", ""):
            host, _, port = args.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"%%accel_launch: --rdzv_endpoint must be host:port (got {args.rdzv_endpoint!r}). "
                                 "Fix: --rdzv_endpoint 10.0.0.1:29500")
            endpoint_host, endpoint_port = host, int(port)
        try:
            base = load_config(args.config_file, missing_ok=False) if args.config_file else load_config()
            return self.session.apply(base).with_overrides(
                num_processes=args.num_processes, mixed_precision=args.mixed_precision, use_cpu=args.cpu,
                start_method=args.start_method, timeout=args.timeout,
                main_process_port=args.port if args.port is not None else endpoint_port,
                num_machines=getattr(args, "num_nodes", None), machine_rank=getattr(args, "node_rank", None),
                main_process_ip=endpoint_host, backend=getattr(args, "backend", None),
                ray_address=getattr(args, "ray_address", None))
        except ConfigError as exc:
            raise _usage(exc) from None

    @staticmethod
    def _request(program: CellProgram, config: LaunchConfig, args: argparse.Namespace) -> LaunchRequest:
        from nbaccel.launch.request import build_request
        from nbaccel.launch.warmup import (
            import_used_exports,
            may_build_ddp,
            source_names,
            start_warmup,
            used_names,
        )

        used = used_names(names=source_names(program.source), namespace=program.namespace())
        warm = may_build_ddp(names=used)
        if warm:
            start_warmup()  # overlaps with the rest of the preparation; joined before any fork
        import_used_exports(used)  # `from nbaccel import Accelerator` in the cell: imported once, here
        try:
            return build_request(run_cell_program, (program,), config=config, output_ranks=args.ranks,
                                 return_all=args.all_ranks, hang_timeout=args.hang_timeout,
                                 rdzv_endpoint=args.rdzv_endpoint, warm_imports=warm, fresh=args.fresh)
        except (ConfigError, EnvironmentStateError, MissingDependencyError) as exc:
            raise _usage(exc) from None

    def _ipython(self) -> InteractiveShell:
        """The shell: set when IPython registers the magics, the only way their methods get called."""
        assert self.shell is not None, "AccelMagics used before IPython registered it"
        return self.shell

    def _program(self, line: str, cell: str, out_names: Sequence[str], all_ranks: bool,
                 kind: type[CellProgram] = CellProgram) -> CellProgram:
        shell = self._ipython()
        first = f"%%accel_launch {line}".rstrip()
        cell_lines = [first + "\n"] + [text + "\n" for text in cell.splitlines()]
        running = getattr(shell.displayhook, "exec_result", None)  # this cell's In[N], however counted
        number = getattr(running, "execution_count", None) or shell.execution_count
        filename = shell.compile.cache("".join(cell_lines), number, raw_code="".join(cell_lines) + "#nbaccel")
        mapped = getattr(shell.compile, "_filename_map", {})
        # IPython caches each cell as a full (size, None, lines, name) entry, never a lazy one
        sources = {name: cast(LinecacheEntry, linecache.cache[name])
                   for name in mapped if name in linecache.cache and name != filename}
        try:
            return kind(shell.transform_cell(cell), filename=filename, first_line=2, cell_lines=cell_lines,
                               user_ns=shell.user_ns, hidden=shell.user_ns_hidden, out_names=out_names,
                               all_ranks=all_ranks, sources=sources)
        except SyntaxError:
            shell.showsyntaxerror()  # as IPython shows a cell's own syntax error: the line, no stack
            raise UsageError("%%accel_launch: the cell has a syntax error (shown above), so no worker was "
                             "started. Fix the line shown and run the cell again.") from None

    @staticmethod
    def _observer(mode: StatusMode, request: LaunchRequest) -> Any:
        n = request.num_processes
        if request.config.num_machines > 1:  # torch's elastic agent runs those workers and streams their output
            if mode in ("widget", "text"):
                raise UsageError(f"%%accel_launch: --status {mode} is not available for multi-machine launches "
                                 "(--num_nodes > 1): torch's elastic agent runs them and streams every rank's "
                                 "output. Fix: drop --status, or use --status none.")
            return None
        if mode == "none":
            return None
        from nbaccel.widgets.status_panel import status_observer

        return status_observer(n, prefer="widget" if mode != "text" else "text",
                               title=f"%%accel_launch: {n} process{'es' if n != 1 else ''}",
                               stream_ranks=request.output_ranks)  # the panel repeats none of the cell's lines

    def _launch(self, request: LaunchRequest, launch: Callable[[LaunchRequest], Any] | None = None) -> Any:
        if launch is None:
            from nbaccel.launch.registry import launch as registry_launch

            launch = registry_launch
        try:
            return launch(request)
        except KeyboardInterrupt as exc:
            if request.launcher == "pool":  # the pool's own words: whether it is still up
                raise plain_interrupt(str(exc)) from None
            raise render_interrupt(request.observer) from None
        except PayloadPicklingError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, PayloadPicklingError) else exc
            raise attach_renderer(cause, self.shell) from None
        except ConfigError as exc:
            if not isinstance(exc, WorkerFailedError):
                raise _usage(exc) from None
            raise attach_renderer(exc, self.shell)  # noqa: B904 - a worker's own ConfigError
        except BaseException as exc:  # noqa: BLE001 - re-raised as it is, with a renderer attached
            raise attach_renderer(exc, self.shell)  # noqa: B904 - keep the worker's exception as it is

    def _finish(self, results: Any, out_names: Sequence[str], all_ranks: bool, cell: str) -> Any:
        user_ns = self._ipython().user_ns
        if all_ranks:
            per_rank: dict[int, CellResult] = {r: v for r, v in (results or {}).items() if isinstance(v, CellResult)}
            for name in out_names:
                user_ns[name] = {r: res.outputs[name] for r, res in sorted(per_rank.items())}
            root = per_rank.get(0)
        else:
            root = results if isinstance(results, CellResult) else None
            if root is not None:
                user_ns.update(root.outputs)
        if root is None or DisplayHook.semicolon_at_end_of_expression(cell):
            return None
        return root.value

    # ------------------------------------------------------------------ %accel_workers
    @magic_arguments()
    @argument("action", nargs="?", default="status", choices=("start", "status", "restart", "stop"),
              help="start the warm workers, show them (the default), restart them, or stop them")
    @argument("-n", "--num_processes", type=int, default=None, help="workers (start only; as for %%accel_launch)")
    @argument("--mixed_precision", choices=get_args(MixedPrecision), default=None, help="(start only)")
    @argument("--cpu", action=argparse.BooleanOptionalAction, default=None, help="CPU workers (start only)")
    @argument("--config_file", default=None, help="config file to read instead of the default one (start only)")
    @argument("--start_method", choices=get_args(StartMethod), default=None, help="(start only)")
    @argument("--port", type=int, default=None, help="rendezvous port (start only; default: a free one)")
    @argument("--timeout", type=positive_seconds, default=None,
              help="cancel a cell after this many seconds (start only)")
    @argument("--backend", choices=get_args(LaunchBackend), default=None, help="'local' or 'ray' (start only)")
    @argument("--ray_address", default=None, help="with --backend ray: the cluster (start only)")
    @argument("--grace", type=positive_seconds, default=3.0,
              help="seconds a cancelled rank has to stop before the pool is killed (start only)")
    @line_magic
    def accel_workers(self, line: str) -> None:
        """Warm workers that live across cells: ``start``, show (``status``), ``restart``, ``stop``.

        Cells starting ``%%accel_launch --persist`` run on them, in a namespace per rank that lasts.

        Example::

            %accel_workers start -n 2 --cpu
            %accel_workers
            %accel_workers stop
        """
        args = parse_flags(self.accel_workers, line, "%accel_workers")
        flags = [n for n, default in (("num_processes", None), ("mixed_precision", None), ("cpu", None),
                                      ("config_file", None), ("start_method", None), ("port", None),
                                      ("timeout", None), ("grace", 3.0), ("backend", None), ("ray_address", None))
                 if getattr(args, n) != default]
        if flags and args.action != "start":
            raise UsageError(f"%accel_workers {args.action} takes no launch flags (got --{flags[0]}); they apply "
                             f"when the workers start. Fix: %accel_workers start --{flags[0]} ...")
        if args.action == "start":
            pool = self.workers.start(self._config(args), args.grace)
            print(f"nbaccel: {pool.num_processes} warm workers started ({pool.start_method}); run cells on them with "
                  "%%accel_launch --persist")
        elif args.action == "restart":
            self.workers.required("%accel_workers restart").restart()
            print("nbaccel: warm workers restarted; their namespaces start empty")
        elif args.action == "stop":
            print("nbaccel: warm workers stopped" if self.workers.stop() else "nbaccel: no warm workers were running")
        else:
            print(self.workers.status())

    # ------------------------------------------------------------------ %accel_config
    @magic_arguments()
    @argument("--config_file", default=None, help="the config file to edit (default: nbaccel's own)")
    @argument("--text", action="store_true", help="print the config as text instead of showing the panel")
    @argument("--clear_session", action="store_true", help="forget this session's defaults")
    @line_magic
    def accel_config(self, line: str) -> Any:
        """Show the launch configuration panel: edit, validate, save, or use for this session.

        Example::

            %accel_config
        """
        args = parse_flags(self.accel_config, line, "%accel_config")
        if args.clear_session:
            self.session.clear()
            print("nbaccel: session defaults cleared; launches use the config file alone.")
            return None
        path = args.config_file or str(config_file_path())
        try:
            base = load_config(args.config_file, missing_ok=False) if args.config_file else load_config()
            shown = self.session.apply(base)
        except ConfigError as exc:
            raise UsageError(f"%accel_config: {exc}") from None
        from nbaccel.widgets.config_panel import ConfigPanel, widgets_available

        panel = ConfigPanel(shown, path=path, base=base, on_use=self.session.set)
        if args.text or not widgets_available() or not (in_notebook() or in_colab()):
            print(panel.text())
            return None
        from IPython.display import display

        display(panel)
        return None

    # ------------------------------------------------------------------ %accel_env
    @line_magic
    def accel_env(self, line: str) -> None:
        """Print the environment report, the same as ``nbaccel env`` in a terminal.

        Example::

            %accel_env
        """
        if line.strip():
            raise UsageError(f"%accel_env takes no arguments (got {line.strip()!r}). Fix: %accel_env")
        from nbaccel.cli.env_cmd import env_report

        print(env_report())
