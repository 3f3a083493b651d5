"""``%accel_runs``: list this kernel's runs, show one again (live), or cancel one.

Every ``%%accel_launch`` cell's run is kept, and every background run (see :mod:`nbaccel.runs`).
After a browser reload the cell that showed a run may be gone; ``%accel_runs show`` shows the
latest run again in the current cell (``%accel_runs show 3`` a given one), with what it printed
while the page was away, live until it ends.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbaccel.runs.registry import all_runs, find_run

__all__ = ["RunsMagics", "format_runs", "start_cell_run"]


def start_cell_run(shell: Any, request: Any, finish: Any, *, name: str | bool, show: bool, pool: Any = None) -> Any:
    """``%%accel_launch --background``: start ``finish(request)`` as a background run; its handle.

    The run holds ``pool`` when given (``--persist``), is bound to ``name`` when it is one, and its
    live view is shown in the cell when ``show`` and the frontend can show it.
    """
    from nbaccel.launch.claims import pool_resource
    from nbaccel.runs.start import cell_label, launch_in_background
    from nbaccel.runs.view import can_show_live

    run = launch_in_background(request, finish, cell=cell_label("%%accel_launch"),
                               resources=[pool_resource(pool)] if pool is not None else [])
    if isinstance(name, str):
        shell.user_ns[name] = run
    if show and can_show_live():
        run.show()
    return run


def format_runs(runs: list[Any]) -> str:
    """The table ``%accel_runs`` prints: id, cell, ranks, state, time, and how it runs.

    Example:
        >>> format_runs([])
        'nbaccel: no runs in this kernel yet. Start one with %%accel_launch --background (or background=True).'
    """
    if not runs:
        return "nbaccel: no runs in this kernel yet. Start one with %%accel_launch --background (or background=True)."
    lines = [f"{'id':>3}  {'cell':<14} {'ranks':>5}  {'state':<10} {'time':>9}  kind"]
    for run in runs:
        lines.append(f"{run.id:>3}  {run.cell[:14]:<14} {run.num_processes:>5}  {run.state:<10} "
                     f"{run.elapsed():>7.1f} s  {'background' if run.background else 'blocking'}")
    lines.append("show one: %accel_runs show ID (the latest without ID); stop one: %accel_runs cancel ID")
    return "\n".join(lines)


def _run(run_id: int | None, command: str) -> Any:
    run = find_run(run_id)
    if run is None:
        ids = [r.id for r in all_runs()]
        if not ids:
            raise UsageError(f"%accel_runs {command}: this kernel has no runs yet. Fix: start one with "
                             "%%accel_launch --background (or notebook_launcher(..., background=True)).")
        raise UsageError(f"%accel_runs {command}: there is no run {run_id}; valid ids: {ids}. "
                         f"Fix: %accel_runs {command} {ids[-1]}")
    return run


@magics_class
class RunsMagics(Magics):
    """``%accel_runs``; ``%load_ext nbaccel`` registers it beside :class:`~nbaccel.magics.magics.AccelMagics`."""

    @magic_arguments()
    @argument("action", nargs="?", default="list", choices=("list", "show", "cancel"),
              help="list the runs (the default), show one live in this cell, or cancel one")
    @argument("id", nargs="?", type=int, default=None, help="the run's id (show: the latest when left out)")
    @line_magic
    def accel_runs(self, line: str) -> None:
        """This kernel's runs: ``%accel_runs``, ``%accel_runs show [ID]``, ``%accel_runs cancel ID``.

        Example::

            %%accel_launch --background -n 2
            train()
            # ... another cell, a browser reload, ...
            %accel_runs show
        """
        args = parse_argstring(self.accel_runs, line)
        if args.action == "list":
            if args.id is not None:
                raise UsageError(f"%accel_runs lists every run and takes no id (got {args.id}). "
                                 f"Fix: %accel_runs show {args.id}")
            print(format_runs(all_runs()))
        elif args.action == "show":
            _run(args.id, "show").show()
        else:
            if args.id is None:
                raise UsageError("%accel_runs cancel needs the id of the run to stop (%accel_runs lists them). "
                                 "Fix: %accel_runs cancel 1")
            run = _run(args.id, "cancel")
            if run.cancel():
                print(f"nbaccel: run {run.id} cancelled; every rank was stopped ({run.state}).")
            else:
                print(f"nbaccel: run {run.id} was not running ({run.state}); nothing to cancel.")
