"""What a worker displays travels to the launching cell: a socket-less IPython shell in each worker.

In a worker, ``get_ipython()`` answers a :class:`WorkerShell`: an ``InteractiveShell`` that owns no
socket and runs no code, so ``display``, ``update_display`` and ``clear_output`` find it and hand
the formatted bundle to its :class:`ForwardingPublisher`, which flushes the rank's text, writes the
bundle as a frame on the control pipe and a mark in stdout (docs/architecture.md, Kernel cut-off
and displays). Libraries see a terminal, not a notebook (no ``IPKernelApp``, not a
``ZMQInteractiveShell``). A widget bundle is dropped with a one-line note, once per worker.
The shell is built once in the caller without ``__init__`` (about 0.5 ms per forked worker); a
spawned worker gets it from an import hook on first use of IPython.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from collections.abc import MutableMapping
from typing import Any, TextIO

from nbaccel.launch.frames import DISPLAY_MARK, write_frame
from nbaccel.launch.worker.import_hooks import when_imported

__all__ = ["FIGURE_BACKEND", "WIDGET_MIME", "flush_quietly", "forward_displays", "note_widget", "route_figures",
           "show_open_figures"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
FIGURE_BACKEND = "module://nbaccel.launch.worker.figure_backend"
_NOTEBOOK_BACKENDS = ("module://matplotlib_inline.backend_inline", "inline", "module://ipympl.backend_nbagg",
                      "ipympl", "widget", "nbagg")
_SHELL_MODULE = "IPython.core.interactiveshell"
_WIDGET_NOTE = ("nbaccel: rank {rank} built a widget ({what}); widgets made in a worker are not shown, because "
                "their state would live in a process the notebook cannot reach. Widgets belong in the notebook: "
                "build it there and update it from the results, or print progress (tqdm.auto prints a text bar "
                "in workers).\n")
_noted: list[bool] = [False]
_forwarding: dict[str, Any] = {}  # the control pipe and rank, once forward_displays() ran


def note_widget(what: str) -> None:
    """Tell the user, once per worker, that the widget ``what`` will not be shown."""
    if _noted[0]:
        return
    _noted[0] = True
    sys.stderr.write(_WIDGET_NOTE.format(rank=_forwarding.get("rank", "?"), what=what))
    sys.stderr.flush()


def flush_quietly(*streams: TextIO | None) -> None:
    """Flush each stream that is there; one closed or broken (``OSError``, ``ValueError``) is passed over."""
    for stream in streams:
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def _send(kind: str, body: dict[str, Any]) -> None:
    if os.getpid() != _forwarding["pid"]:  # a process forked from the worker (a DataLoader worker, an XLA
        if kind == "display":             # replica): the rank's pipe is its parent's alone; show the text
            print(body["data"].get("text/plain", ""), flush=True)
        return
    flush_quietly(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)  # what was printed goes first
    with _forwarding["lock"]:  # a display from another thread must not split a frame
        write_frame(_forwarding["ctl_fd"], kind, body)
        os.write(1, DISPLAY_MARK)  # fd 1 itself: a redirected sys.stdout must not swallow the mark


@functools.cache
def _publisher_class() -> type:
    from IPython.core.displaypub import DisplayPublisher

    class ForwardingPublisher(DisplayPublisher):
        """Sends display bundles to the supervisor instead of a kernel's IOPub socket."""

        def publish(self, data: dict[str, Any], metadata: dict[str, Any] | None = None, source: Any = None, *,
                    transient: dict[str, Any] | None = None, update: bool = False, **kwargs: Any) -> None:
            self._validate_data(data, metadata)
            if WIDGET_MIME in data:
                note_widget(str(data.get("text/plain", "a widget")))
                return
            _send("display", {"data": data, "metadata": metadata or {}, "transient": transient or {},
                              "update": update})

        def clear_output(self, wait: bool = False) -> None:
            _send("clear_output", {"wait": wait})

    return ForwardingPublisher


@functools.cache
def _shell_class() -> type:
    from IPython.core.interactiveshell import InteractiveShell

    class WorkerShell(InteractiveShell):
        """The worker's ``get_ipython()``: formats and publishes displays; owns no socket, runs no code.

        Built without ``InteractiveShell.__init__`` (no history database, magics or namespaces),
        so only the display machinery, ``config`` and ``events`` are usable.
        """

        def enable_gui(self, gui: str | None = None) -> None:  # matplotlib asks; a worker has no event loop
            return None

        def showtraceback(self, exc_tuple: Any = None, *args: Any, **kwargs: Any) -> None:
            """A formatter that raised (IPython reports it and shows the text form): Python's own traceback."""
            etype, value, tb = exc_tuple if exc_tuple is not None else sys.exc_info()
            traceback.print_exception(etype, value, tb, file=sys.stderr)

    return WorkerShell


def _png(figure: Any) -> bytes | None:
    from IPython.core.pylabtools import print_figure

    return print_figure(figure, "png")


@functools.cache
def _worker_shell() -> Any:
    """The shell every worker of this process installs (built once: a traited class costs ~25 ms to create)."""
    from IPython.core.events import EventManager, available_events

    cls: Any = _shell_class()  # its own __new__ (traitlets') runs: mypy would resolve type.__new__
    shell = cls.__new__(cls)
    shell.events = EventManager(shell, available_events)
    shell.display_pub = _publisher_class()()
    return shell


def _install_shell() -> None:
    """Put the worker's shell where ``get_ipython()`` and ``display()`` look, keeping the notebook's formatters."""
    from IPython.core.formatters import DisplayFormatter
    from IPython.core.interactiveshell import InteractiveShell

    inherited = InteractiveShell._instance if InteractiveShell.initialized() else None
    shell = _worker_shell()
    if inherited is not None and inherited is not shell:
        shell.display_formatter = inherited.display_formatter  # this worker's copy of the notebook's
        type(inherited).clear_instance()
    elif shell.display_formatter is None:
        shell.display_formatter = DisplayFormatter()
    png = shell.display_formatter.formatters["image/png"]
    png.for_type_by_name("matplotlib.figure", "Figure", _png)  # as the inline backend registers it
    for cls in type(shell).mro():
        if isinstance(cls, type) and issubclass(cls, InteractiveShell):
            cls._instance = shell  # what SingletonConfigurable.instance() would have done


def forward_displays(ctl_fd: int, rank: int) -> None:
    """Route this worker's displays to its control pipe ``ctl_fd`` (call once, in the worker process).

    Installs the :class:`WorkerShell` now when IPython is loaded (a forked worker), else when it
    first is. A test drives it in a real worker: ``tests/launch/test_worker_display.py``.
    """
    _forwarding.update(ctl_fd=ctl_fd, rank=rank, pid=os.getpid(), lock=threading.Lock())
    when_imported(_SHELL_MODULE, lambda _: _install_shell())


def route_figures(environ: MutableMapping[str, str]) -> None:
    """Make matplotlib in this worker draw with :mod:`nbaccel.launch.worker.figure_backend`.

    Only where the notebook's backend would have shown figures in the cell (the inline one, a
    widget one, or none chosen): a backend the user picked on purpose (``agg`` to save files)
    stays. ``environ`` is the worker's ``os.environ`` (``MPLBACKEND`` is matplotlib's setting).
    """
    if environ.get("MPLBACKEND", "") in ("", *_NOTEBOOK_BACKENDS):
        environ["MPLBACKEND"] = FIGURE_BACKEND  # read when matplotlib is first imported
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is None:
        return
    current = dict.__getitem__(matplotlib.rcParams, "backend")  # without resolving the automatic choice
    if isinstance(current, str) and current.lower() not in _NOTEBOOK_BACKENDS:
        return
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        matplotlib.rcParams["backend"] = FIGURE_BACKEND
    else:
        pyplot.switch_backend(FIGURE_BACKEND)  # the worker's copies of the notebook's figures close


def show_open_figures() -> None:
    """Show the figures a worker left open, as the inline backend does when a cell ends."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or "nbaccel.launch.worker.figure_backend" not in sys.modules:
        return
    if pyplot.get_backend() == FIGURE_BACKEND and pyplot.get_fignums():
        sys.modules["nbaccel.launch.worker.figure_backend"].show_open_figures()


if _SHELL_MODULE in sys.modules:  # the caller is an IPython shell: build it here once, not in every forked worker
    _worker_shell()
