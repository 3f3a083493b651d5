"""One rank as a Ray actor: the worker body of every launcher, run inside a Ray worker process.

The launcher (:mod:`nbaccel.launch.ray.launcher`) makes this class a Ray actor with a few threads, one
per rank, in its placement-group bundle. :meth:`RankActor.run` is the rank: it applies the same
environment a local worker gets, points fd 1 and 2 and a control pipe at a reader thread, and
runs :func:`~nbaccel.launch.worker.process.run_body` (identity, ``started``, the function, ``result`` or
``error``). What the reader collects, the launcher fetches with :meth:`RankActor.drain`, a long
poll answered from another thread of the actor, and feeds to the same supervisor a local launch
uses. So output, displays, ``accelerator.log`` records and failures travel exactly as locally:
as bytes of the same pipes, just carried by Ray between machines.

Stopping: :meth:`interrupt` raises ``KeyboardInterrupt`` in the rank's thread while the
function runs (a blocking collective sees it only when it returns); ``ray.kill`` ends the actor.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import selectors
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

from nbaccel.environment import apply_environment, read_distributed_env
from nbaccel.host_memory import resident_bytes
from nbaccel.identity import WorkerIdentity
from nbaccel.launch.payload import cpu_copies
from nbaccel.rank_lifecycle import RankLifecycle
from nbaccel.launch.worker.console_tqdm import use_console_tqdm
from nbaccel.launch.worker.display import (
    flush_quietly,
    forward_displays,
    route_figures,
    show_open_figures,
)
from nbaccel.launch.worker.process import run_body

__all__ = ["RankActor"]

_STREAMS = ("ctl", "stdout", "stderr")
_READ_SIZE = 1 << 20


class _Capture:
    """fd 1 and 2 and a control pipe, read by one thread into buffers while a run lasts.

    A display frame is written to the control pipe just before its mark goes to stdout. The
    reader drains the control pipe before it files what it read from stdout, in one step under
    the lock, so a :meth:`take` never hands out a mark whose frame is still in the pipe: the
    mark can be read in the same ``read()`` as the line printed before it, after the frame went in.
    """

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.buffers: dict[str, bytearray] = {name: bytearray() for name in _STREAMS}
        self.ready = threading.Condition()
        self.finished = False
        ctl_r, self.ctl_w = os.pipe()
        os.set_blocking(ctl_r, False)
        self._ctl_r: int | None = ctl_r
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
        self._selector = selectors.DefaultSelector()
        for fd, name in zip((ctl_r, out_r, err_r), _STREAMS):
            self._selector.register(fd, selectors.EVENT_READ, name)
        self._reader = threading.Thread(target=self._read, daemon=True, name="nbaccel-rank-output")
        self._reader.start()

    def _read(self) -> None:
        try:
            while self._selector.get_map():
                for key, _ in self._selector.select():
                    if key.fd in self._selector.get_map():  # not closed by a drain earlier in this batch
                        self._read_one(key.data, key.fd)
        finally:
            self._selector.close()

    def _read_one(self, name: str, fd: int) -> None:
        if name == "ctl":
            control = self._control_bytes()
            data = b""
        else:
            data = os.read(fd, _READ_SIZE)
            if not data:
                self._close(fd)
                return
            control = self._control_bytes() if name == "stdout" else b""  # a mark's frame is in by now
        with self.ready:
            self.buffers["ctl"] += control
            self.buffers[name] += data
            self.ready.notify_all()

    def _control_bytes(self) -> bytes:
        """Everything in the control pipe now (it never blocks); closes the pipe at its end."""
        parts: list[bytes] = []
        while self._ctl_r is not None:
            try:
                part = os.read(self._ctl_r, _READ_SIZE)
            except BlockingIOError:
                break
            if not part:
                self._close(self._ctl_r)
                self._ctl_r = None
                break
            parts.append(part)
        return b"".join(parts)

    def _close(self, fd: int) -> None:
        self._selector.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        """Give fd 1 and 2 back, wait for the reader to reach the end of every pipe, and mark the run done."""
        out_saved, err_saved, stdout, stderr = self._saved
        flush_quietly(sys.stdout, sys.stderr)
        os.dup2(out_saved, 1)
        os.dup2(err_saved, 2)
        os.close(out_saved)
        os.close(err_saved)
        os.close(self.ctl_w)
        sys.stdout, sys.stderr = stdout, stderr
        self._reader.join(timeout=2.0)  # a subprocess still holding a pipe must not hold the run
        with self.ready:
            self.finished = True
            self.ready.notify_all()

    def take(self, wait: float) -> tuple[bytes, bytes, bytes, bool]:
        """What was read since the last call (waiting up to ``wait`` s for something), and whether the run ended."""
        with self.ready:
            if not self.finished and not any(self.buffers.values()):
                self.ready.wait(wait)
            parts = tuple(bytes(self.buffers[name]) for name in _STREAMS)
            for buffer in self.buffers.values():
                buffer.clear()
            return parts[0], parts[1], parts[2], self.finished


class RankActor:
    """The Ray actor behind one rank (see the module docstring); plain Python until made remote."""

    def __init__(self) -> None:
        self._capture: _Capture | None = None
        self._thread: int | None = None
        self._cancellable = False
        self._pending_interrupt = False
        self._store: Any = None
        self._lifecycle = RankLifecycle()

    # ------------------------------------------------------------------ placement
    def where(self, bundle: int) -> dict[str, Any]:
        """Which node this actor runs on, its address, pid, the GPUs Ray gave it, and the node's CPUs.

        It also imports torch.distributed, which every rank needs (rank 0 for the store, all for the
        group): done here, every actor imports it at the same time instead of rank 0 alone, in
        series, before the others may start.
        """
        import ray
        import torch.distributed  # noqa: F401 - see above

        context = ray.get_runtime_context()
        node_id = context.get_node_id()
        cpus = next((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == node_id), 1)
        return {"bundle": bundle, "node_id": node_id, "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": tuple(str(g) for g in ray.get_gpu_ids()), "node_cpus": float(cpus)}

    def host_store(self, host: str, timeout: float) -> int:
        """Host the job's rendezvous store on ``host`` (rank 0's node) for the actor's life; returns its port."""
        from datetime import timedelta

        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(host, 0, world_size=None, is_master=True, use_libuv=True,
                                        wait_for_workers=False, timeout=timedelta(seconds=timeout))
        return int(self._store.port)

    def prepare(self, env: Mapping[str, str], lifecycle: RankLifecycle) -> None:
        """Become a worker: the environment a local worker gets, and a fresh start through ``lifecycle``."""
        apply_environment(env)
        route_figures(os.environ)
        torch = sys.modules.get("torch")
        if torch is not None and "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        self._lifecycle = lifecycle
        lifecycle.start_afresh()  # the notebook's state and identity are not this rank's
        use_console_tqdm()

    def join_group(self) -> str:
        """Join the process group now (a pool's ranks, once for its life); returns this rank's device."""
        return self._lifecycle.join_group()  # with CPU collectives: the group outlives any one task

    # ------------------------------------------------------------------ running
    def run(self, run_id: int, payload: bytes, rank: int, send_result: bool, cpu_results: bool = False) -> int:
        """Run the cloudpickled ``(function, args, kwargs)`` as rank ``rank``; 0 done, 1 failed, 130 interrupted.

        Everything the rank says goes to the capture that :meth:`drain` empties; the return code only
        tells the launcher the run is over (its result or error is in the control bytes).
        """
        capture = self._capture = _Capture(run_id)
        self._thread, self._pending_interrupt = threading.get_ident(), False
        code = 0
        try:
            forward_displays(capture.ctl_w, rank)
            task = self._task(payload, cpu_results)
            dist = read_distributed_env()  # what the launcher gave this rank (torchrun's variables)
            identity = WorkerIdentity.from_distributed_env(dist) if dist is not None else None
            failed = run_body(capture.ctl_w, rank, identity, task, (), {}, send_result=send_result)
            if failed is not None:
                code = 130 if isinstance(failed, KeyboardInterrupt) else 1
            else:
                show_open_figures()  # as the inline backend does when a cell ends
        finally:
            self._thread = None
            capture.close()
        return code

    def _task(self, payload: bytes, cpu_results: bool) -> Callable[[], Any]:
        def task() -> Any:
            function, args, kwargs = cloudpickle.loads(payload)  # a failure here is the rank's error
            self._cancellable = True
            try:
                if self._pending_interrupt:
                    raise KeyboardInterrupt("interrupted by the launcher")
                result = function(*args, **kwargs)
            finally:
                self._cancellable = False
            return cpu_copies(result) if cpu_results else result
        return task

    def drain(self, run_id: int, wait: float) -> tuple[bytes, bytes, bytes, bool]:
        """Run ``run_id``'s control, stdout and stderr bytes since the last call, and whether it ended.

        Waits up to ``wait`` seconds when there is nothing yet (a long poll).
        """
        capture = self._capture
        if capture is None or capture.run_id != run_id:  # asked before the run began here
            time.sleep(min(wait, 0.05))
            return b"", b"", b"", False
        return capture.take(wait)

    def interrupt(self) -> bool:
        """Raise ``KeyboardInterrupt`` in the running function; returns whether a run was there to interrupt."""
        thread = self._thread
        if thread is None:
            return False
        if not self._cancellable:
            self._pending_interrupt = True  # raised as the function starts
            return True
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(KeyboardInterrupt))
        return True

    def dump_stacks(self) -> None:
        """Write the rank's Python stack to its stderr, as a local worker does on SIGUSR1."""
        thread = self._thread
        frame = sys._current_frames().get(thread) if thread is not None else None
        if frame is None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return
        text = "".join(traceback.format_stack(frame))
        sys.stderr.write(f"Thread 0x{thread:x} (most recent call last):\n{text}")
        sys.stderr.flush()

    def resident_bytes(self) -> int | None:
        """This actor's resident memory (``None`` where the system does not say)."""
        return resident_bytes()
