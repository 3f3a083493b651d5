"""Reading safetensors tensors onto GPUs: reader threads, pinned buffers, asynchronous copies.

::

    files (one descriptor each, open for the whole load)
      └─ reads of up to `buffer_bytes`, in file order (plan_reads: small neighbours share a
         read; a big tensor spans several)
           └─ reader thread × N, each with its own 2 pinned buffers and a copy stream per GPU:
              preadv into a buffer ─► non_blocking copies of its pieces into the tensors
              (a buffer is refilled only after the copies out of it are done: its event)

What always holds: each result holds exactly the file's bytes, in the stored dtype; every copy
has finished when :func:`read_to_devices` returns; all GPUs of a load are fed at once, by the
same threads; a file that is gone or cut short is a :class:`~nbaccel.errors.CheckpointError`,
raised after the other threads stopped (no thread outlives the call). On a device other than
CUDA the same reads are copied synchronously. An interrupt (Ctrl-C) in the calling thread stops
the readers after the read each has in hand and is raised within milliseconds, not after the load;
the results are then dropped, so a model being loaded is left as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nbaccel.big_modeling.checkpoint_files import TensorInfo
from nbaccel.big_modeling.cpu_copies import FileDescriptors, copy_threads, wait_all
from nbaccel.big_modeling.pinned_slabs import host_buffer
from nbaccel.big_modeling.tensors import cpu_memoryview

__all__ = ["BUFFER_BYTES", "Read", "plan_reads", "read_to_devices"]

# 8 readers hold 256 MiB pinned (exactly: host_buffer, given back when the load ends);
# 16 MiB copies already run at the bus's speed.
BUFFER_BYTES = 16 * 2**20
BUFFERS_PER_READER = 2  # one being filled while the copies out of the other run


@dataclass
class Read:
    """One ``preadv`` of ``nbytes`` at ``offset`` in ``path``, and where its bytes go:
    ``pieces`` of ``(tensor index, byte in the tensor, byte in the read, length)``."""

    path: str
    offset: int
    nbytes: int = 0
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


def plan_reads(infos: Sequence[TensorInfo], buffer_bytes: int) -> list[Read]:
    """Cut the tensors' bytes into reads of at most ``buffer_bytes``, in file order.

    Tensors that follow each other in a file share reads (small tensors are batched); a tensor
    bigger than a buffer spans several; a gap in the file starts a new read.

    Example:
        >>> a = TensorInfo("f", 0, 6, torch.uint8, (6,)); b = TensorInfo("f", 6, 4, torch.uint8, (4,))
        >>> [(r.offset, r.nbytes, r.pieces) for r in plan_reads([a, b], 8)]
        [(0, 8, [(0, 0, 0, 6), (1, 0, 6, 2)]), (8, 2, [(1, 2, 0, 2)])]
    """
    reads: list[Read] = []
    current: Read | None = None
    for k in sorted(range(len(infos)), key=lambda i: (infos[i].path, infos[i].offset)):
        info, done = infos[k], 0
        while done < info.nbytes:
            position = info.offset + done
            if current is None or current.path != info.path or \
                    current.offset + current.nbytes != position or current.nbytes == buffer_bytes:
                current = Read(info.path, position)
                reads.append(current)
            n = min(info.nbytes - done, buffer_bytes - current.nbytes)
            current.pieces.append((k, done, current.nbytes, n))
            current.nbytes += n
            done += n
    return reads


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _Reader:
    """One reader thread's buffers and streams; reads taken from a shared queue."""

    def __init__(self, size: int, devices: set[torch.device], waits_for: dict[torch.device, Any]) -> None:
        self.cuda = any(d.type == "cuda" for d in devices)
        self.buffers = [host_buffer(size, pin=self.cuda) for _ in range(BUFFERS_PER_READER)]
        self.done: list[list[Any]] = [[] for _ in self.buffers]
        self.streams: dict[torch.device, Any] = {}
        for device in devices:
            if device.type == "cuda":
                stream = self.streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(waits_for[device])  # the results were allocated there

    def run(self, take: Callable[[], Read | None], files: FileDescriptors,
            outs: Sequence[torch.Tensor], on_piece: Callable[[int, int], None] | None) -> None:
        turn = 0
        try:
            while (read := take()) is not None:
                slot, turn = turn % len(self.buffers), turn + 1
                for event in self.done[slot]:
                    event.synchronize()  # the copies out of this buffer are done
                buffer = self.buffers[slot][:read.nbytes]
                files.read(TensorInfo(read.path, read.offset, read.nbytes, torch.uint8, (read.nbytes,)),
                           cpu_memoryview(buffer), 0)
                self.done[slot] = self._copy(read, buffer, outs)
                if on_piece is not None:
                    for k, _, _, n in read.pieces:
                        on_piece(k, n)
        finally:
            for stream in self.streams.values():
                stream.synchronize()

    def _copy(self, read: Read, buffer: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[Any]:
        used = {}
        for k, start, at, n in read.pieces:
            device = outs[k].device
            stream = self.streams.get(device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _bytes(outs[k])[start:start + n].copy_(buffer[at:at + n], non_blocking=stream is not None)
            if stream is not None:
                used[device] = stream
        events = []
        for stream in used.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events


def read_to_devices(infos: Sequence[TensorInfo], devices: Sequence[torch.device | str],
                    buffer_bytes: int = BUFFER_BYTES, readers: int | None = None,
                    on_piece: Callable[[int, int], None] | None = None,
                    on_wait: Callable[[], None] | None = None,
                    wake: threading.Event | None = None) -> list[torch.Tensor]:
    """Read tensors from their files into new tensors, each on its own device, on reader threads.

    Args:
        infos: where each tensor is; read in its stored dtype.
        devices: the device of each tensor (several GPUs load at once).
        buffer_bytes: each pinned buffer's size (at most the largest read).
        readers: reader threads (default :func:`~.cpu_copies.copy_threads`).
        on_piece: called ``(tensor index, bytes)`` from a reader as bytes are issued (progress).
        on_wait: called in the calling thread while the readers run: whenever ``wake`` is set,
            and about every 0.1 s (draws progress).
        wake: an event the progress reports set, so that ``on_wait`` runs at once.

    Returns:
        The tensors, in the order of ``infos``; every copy has finished.

    Raises:
        CheckpointError: a file is gone, or ends before one of its tensors does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"a": torch.arange(5.0), "b": torch.ones(2)}, path)
        >>> infos = list(SafetensorsFile(path).tensors.values())
        >>> [t.tolist() for t in read_to_devices(infos, ["cpu", "cpu"], buffer_bytes=8)]
        [[0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 1.0]]
    """
    targets = [torch.device(d) for d in devices]
    outs = [torch.empty(i.shape, dtype=i.dtype, device=d) for i, d in zip(infos, targets)]
    reads = plan_reads(infos, buffer_bytes)
    if not reads:
        return outs
    files = FileDescriptors(infos)
    try:
        _run_readers(reads, files, outs, {o.device for o in outs}, readers, on_piece, on_wait, wake)
    finally:
        files.close()
    return outs


def _run_readers(reads: list[Read], files: FileDescriptors, outs: Sequence[torch.Tensor],
                 devices: set[torch.device], readers: int | None,
                 on_piece: Callable[[int, int], None] | None,
                 on_wait: Callable[[], None] | None, wake: threading.Event | None) -> None:
    """Run the readers over the shared queue; the first error, or an interrupt in the calling
    thread, stops the others after the read each has in hand, and is raised once they have."""
    size = max(r.nbytes for r in reads)
    count = max(1, min(readers or copy_threads(), len(reads)))
    waits_for = {d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"}
    lock, queue, failed = threading.Lock(), iter(reads), threading.Event()

    def take() -> Read | None:
        with lock:
            return None if failed.is_set() else next(queue, None)

    def work() -> None:
        try:
            _Reader(size, devices, waits_for).run(take, files, outs, on_piece)
        except BaseException:
            failed.set()
            raise

    pool = ThreadPoolExecutor(count, thread_name_prefix="nbaccel-gpu-read")
    try:
        futures = [pool.submit(work) for _ in range(count)]
        wait_all(futures, on_wait, wake)
    finally:
        failed.set()  # Ctrl-C: no reader takes another read (each is one buffer, milliseconds)
        pool.shutdown(wait=True)
    for future in futures:
        future.result()
