"""Cutting a worker off the Jupyter kernel it was forked from.

A worker forked from a kernel inherits the kernel's ZeroMQ sockets and the objects that use them
(the shell singleton, ipykernel's ``Kernel`` and ``IPKernelApp``, the display hook, the comm
functions, the session); several processes must never write to one socket. :func:`detach_from_kernel`
makes all of it unreachable, in this order: the session's ``send`` drops messages (noted once on
the rank's stderr); ``get_ipython()`` no longer answers the kernel's shell and ipykernel's
singletons are cleared; ``sys.displayhook`` / ``sys.excepthook`` are Python's own again;
``comm.create_comm`` builds a comm that sends nothing; ``ipykernel.zmqshell`` leaves
``sys.modules`` and ``tqdm.auto`` / ``tqdm.notebook`` draw text bars. Nothing is imported here: each
step applies to what the worker has loaded (a ``comm`` imported later: :mod:`nbaccel.launch.worker.import_hooks`).
"""

from __future__ import annotations

import sys
from typing import Any

from nbaccel.launch.worker.display import note_widget
from nbaccel.launch.worker.import_hooks import when_imported

__all__ = ["detach_from_kernel"]

_dropped: list[str] = []


def _drop_message(self: Any, stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> None:
    kind = msg_or_type.get("msg_type", "?") if isinstance(msg_or_type, dict) else str(msg_or_type)
    if not _dropped:
        sys.stderr.write(f"nbaccel: a worker tried to send a {kind!r} message through the Jupyter kernel's own "
                         "channel, which only the kernel may use; it was dropped (workers' output reaches the "
                         "cell through nbaccel).\n")
    _dropped.append(kind)
    return None


def _cut_session() -> None:
    session = sys.modules.get("jupyter_client.session")
    if session is not None:
        session.Session.send = _drop_message


def _clear_kernel_singletons() -> None:
    for module_name, class_name in (("ipykernel.kernelapp", "IPKernelApp"), ("ipykernel.kernelbase", "Kernel")):
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None and cls.initialized():
            type(cls.instance()).clear_instance()  # the subclass's own (IPythonKernel) goes too


def _cut_comms(comm: Any) -> None:  # the comm package: its functions are replaced
    manager = comm.base_comm.CommManager()

    def create_comm(*args: Any, **kwargs: Any) -> Any:
        note_widget(str(kwargs.get("target_name", "a comm")))
        return comm.DummyComm(*args, **kwargs)

    comm.create_comm = create_comm
    comm.get_comm_manager = lambda: manager


def _text_progress_bars() -> None:
    sys.modules.pop("ipykernel.zmqshell", None)  # a worker is not a kernel; tqdm.autonotebook tests this name
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is None:
        return
    for name in ("__init__", "__iter__", "update", "close", "clear", "reset", "display", "status_printer", "colour"):
        if name in vars(notebook.tqdm_notebook):  # a bar class the notebook already holds now draws as text
            delattr(notebook.tqdm_notebook, name)
    modules: dict[str, Any] = sys.modules  # tqdm's modules: their classes are replaced below
    std, asyncio = modules.get("tqdm.std"), modules.get("tqdm.asyncio")
    auto, autonotebook = modules.get("tqdm.auto"), modules.get("tqdm.autonotebook")
    if autonotebook is not None and std is not None and issubclass(autonotebook.tqdm, notebook.tqdm):
        autonotebook.tqdm, autonotebook.trange = std.tqdm, std.trange
    if auto is not None and asyncio is not None and issubclass(auto.tqdm, notebook.tqdm):
        auto.tqdm = asyncio.tqdm  # what tqdm.auto is outside a notebook; auto.trange reads it


def detach_from_kernel() -> None:
    """Make the inherited kernel machinery unreachable in this worker (see the module docstring).

    Call it in the worker process, after its stdout and stderr are its own and before
    :func:`~nbaccel.launch.worker.display.forward_displays` installs the worker's shell.
    """
    _cut_session()
    _clear_kernel_singletons()
    sys.displayhook = sys.__displayhook__
    sys.excepthook = sys.__excepthook__
    when_imported("comm", _cut_comms)  # ipywidgets 8 builds its comms through this package
    _text_progress_bars()
