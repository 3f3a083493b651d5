"""Copying safetensors tensors into fresh CPU tensors, on a few threads: the weights that cannot be views.

A resident CPU weight is a view of its file when it can be (``resident.FileMaps``); it must be
a copy when its file offset is off the allocator's 64-byte alignment (most safetensors files
written by others sit 8 bytes off, see :func:`~.checkpoint_files.can_map`) or when the model
wants another dtype. Copying 1 GiB costs two things of about equal size: faulting in (and
zeroing) every page of new memory, and moving the bytes. :func:`copy_to_cpu` overlaps them
across cores:

- One thread pool per load (not per tensor), of :func:`copy_threads` threads. Tensors are cut
  into chunks of :data:`CHUNK_BYTES`, taken in file order; each chunk's destination pages are
  pre-faulted (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+; older kernels fault them on the
  first write instead), then filled by ``os.preadv``, which releases the GIL.
- A dtype change casts chunk by chunk from a mapped view of the file (element-aligned offsets;
  torch's ``copy_`` releases the GIL too): no intermediate full-size copy in the stored dtype.
  A tensor whose offset is not even a multiple of its element size is read, then cast.

What always holds: each result owns fresh memory, holds exactly the bytes (or the cast of
exactly the values) a plain ``load_state_dict`` would, and is 64-byte aligned as torch
allocates it; writing to it never reaches the file. A file that is gone or ends early is a
:class:`~nbaccel.errors.CheckpointError` naming it, raised before the load returns; chunks
not yet started are dropped and the ones being copied are waited for (no thread outlives the
call), and an interrupt does the same.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nbaccel.big_modeling.checkpoint_files import (
    TensorInfo,
    read_tensor,
    truncated_error,
)
from nbaccel.big_modeling.tensors import cpu_memoryview
from nbaccel.errors import CheckpointError

__all__ = ["CHUNK_BYTES", "FileDescriptors", "copy_threads", "copy_to_cpu", "populate", "wait_all"]

CHUNK_BYTES = 4 * 2**20  # small enough to spread a 16 MiB weight over the cores, big enough
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # <linux/mman.h>, Linux 5.14+; EINVAL before
MAX_THREADS = 8  # copying is bound by memory bandwidth: more threads than this only contend


def copy_threads() -> int:
    """How many threads copy: the CPUs this process may run on, at most :data:`MAX_THREADS`.

    Example:
        >>> 1 <= copy_threads() <= MAX_THREADS
        True
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(usable or 1, MAX_THREADS))


def populate(address: int, size: int, advice: int) -> bool:
    """Fault in the pages of ``[address, address + size)`` now (``advice`` is
    :data:`MADV_POPULATE_READ` or :data:`MADV_POPULATE_WRITE`); whole pages, rounded outwards.

    Returns:
        Whether the kernel did it; ``False`` on kernels before 5.14, which leave the pages to be
        faulted in on first use (nothing else changes).

    Example:
        >>> t = torch.empty(2**20, dtype=torch.uint8)
        >>> populate(t.data_ptr(), t.nbytes, MADV_POPULATE_WRITE) in (True, False)
        True
    """
    if size <= 0:
        return True
    start = address - address % mmap.PAGESIZE
    return _madvise(start, address + size - start, advice) == 0


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _madvise(address: int, size: int, advice: int) -> int:
    return _LIBC.madvise(address, size, advice)


class FileDescriptors:
    """One read-only descriptor per file for the whole load, closed by :meth:`close`; every
    file's size is checked against its tensors when opened.

    Raises:
        CheckpointError: a file is gone, or ends before one of its tensors does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(2.0)}, path)
        >>> info = SafetensorsFile(path).tensors["w"]
        >>> files = FileDescriptors([info]); out = bytearray(8); files.read(info, memoryview(out), 0)
        >>> files.close(); torch.frombuffer(out, dtype=torch.float32)
        tensor([0., 1.])
    """

    def __init__(self, infos: Sequence[TensorInfo]) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        try:
            for info in infos:
                if info.path not in self._fds:
                    self._fds[info.path] = self._open(info)
                size = os.fstat(self._fds[info.path]).st_size
                if size < info.offset + info.nbytes:
                    raise truncated_error(info, size)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(info: TensorInfo) -> int:
        try:
            return os.open(info.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(
                f"cannot open {info.path} to read its tensors ({exc.strerror}); its header was read "
                "a moment ago, so it was moved or removed while loading. Keep the checkpoint in place "
                "until the load returns.", path=info.path) from None

    def read(self, info: TensorInfo, out: memoryview, start: int) -> None:
        """Fill ``out`` with the tensor's bytes from byte ``start`` on."""
        fd, done = self._fds[info.path], 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], info.offset + start + done)
            if n == 0:  # the file shrank after the size check
                raise truncated_error(info, info.offset + start + done)
            done += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def wait_all(futures: Sequence[Future], on_wait: Callable[[], None] | None = None,
             wake: threading.Event | None = None, every: float = 0.1) -> None:
    """Wait until every future is done or one has failed, calling ``on_wait`` in this thread
    each time ``wake`` is set (a reader finished something worth showing), about every
    ``every`` seconds, and once at the end. An interrupt raises here at once; stopping the
    threads is the caller's.

    Example:
        >>> done = Future(); done.set_result(None); wait_all([done])
    """
    wake = wake if wake is not None else threading.Event()
    lock, state = threading.Lock(), {"left": len(futures), "failed": False}

    def finished(future: Future) -> None:
        with lock:
            state["left"] -= 1
            state["failed"] |= not future.cancelled() and future.exception() is not None
        if state["left"] == 0 or state["failed"]:
            wake.set()

    for future in futures:
        future.add_done_callback(finished)
    while state["left"] and not state["failed"]:
        wake.wait(every)
        wake.clear()  # the loop's condition is read after this: a last finish is never missed
        if on_wait is not None:
            on_wait()
    if on_wait is not None:
        on_wait()  # the last reports drawn too, however fast the threads were


def _chunk_jobs(infos: Sequence[TensorInfo], outs: Sequence[torch.Tensor],
                sources: Sequence[torch.Tensor | None], files: FileDescriptors,
                chunk_bytes: int, on_piece: Callable[[int, int], None] | None = None
                ) -> list[Callable[[], None]]:
    """One job per chunk, in file order: pre-fault the destination, then read or cast into it;
    ``on_piece(tensor index, stored bytes)`` once it is done."""
    jobs: list[Callable[[], None]] = []
    for k in sorted(range(len(infos)), key=lambda i: (infos[i].path, infos[i].offset)):
        info, out, source = infos[k], outs[k], sources[k]
        if out.numel() == 0:
            continue
        flat = out.reshape(-1)
        step = max(1, chunk_bytes // max(out.element_size(), source.element_size() if source is not None else 1))
        for first, last in _cuts(flat, step):
            if source is None:
                job = _read_job(files, info, flat, first, last)
            else:
                job = _cast_job(source.reshape(-1), flat, first, last)
            jobs.append(job if on_piece is None else
                        _reported(job, on_piece, k, (last - first) * info.dtype.itemsize))
    return jobs


def _reported(job: Callable[[], None], on_piece: Callable[[int, int], None], k: int,
              nbytes: int) -> Callable[[], None]:
    def reported() -> None:
        job()
        on_piece(k, nbytes)
    return reported


def _cuts(flat: torch.Tensor, step: int) -> list[tuple[int, int]]:
    """``(first, last)`` element ranges of at most ``step`` elements whose inner boundaries sit on
    multiples of the chunk size in memory (so on page boundaries), where the element size allows:
    two threads then never fault in or write the same page (cut anywhere, loading 1 GiB took
    about 20% longer on 2 cores)."""
    size, start = flat.element_size(), flat.data_ptr()
    span = step * size
    first_cut = (-start) % span  # bytes from the start to the next multiple of the chunk size
    if span % mmap.PAGESIZE or first_cut % size:
        bounds = list(range(0, flat.numel(), step))
    else:
        bounds = [0, *range(first_cut // size or step, flat.numel(), step)]
    return [(a, b) for a, b in zip(bounds, [*bounds[1:], flat.numel()]) if b > a]


def _read_job(files: FileDescriptors, info: TensorInfo, flat: torch.Tensor, first: int,
              last: int) -> Callable[[], None]:
    def job() -> None:
        size = flat.element_size()
        populate(flat.data_ptr() + first * size, (last - first) * size, MADV_POPULATE_WRITE)
        view = cpu_memoryview(flat[first:last].view(torch.uint8))
        files.read(info, view, first * size)
    return job


def _cast_job(source: torch.Tensor, flat: torch.Tensor, first: int, last: int) -> Callable[[], None]:
    def job() -> None:
        populate(source.data_ptr() + first * source.element_size(), (last - first) * source.element_size(),
                 MADV_POPULATE_READ)
        populate(flat.data_ptr() + first * flat.element_size(), (last - first) * flat.element_size(),
                 MADV_POPULATE_WRITE)
        flat[first:last].copy_(source[first:last])  # the same elementwise cast as .to(dtype)
    return job


def copy_to_cpu(infos: Sequence[TensorInfo], dtypes: Sequence[torch.dtype] | None = None,
                view: Callable[[TensorInfo], torch.Tensor | None] | None = None,
                threads: int | None = None, chunk_bytes: int = CHUNK_BYTES,
                on_piece: Callable[[int, int], None] | None = None,
                on_wait: Callable[[], None] | None = None,
                wake: threading.Event | None = None) -> list[torch.Tensor]:
    """Copy tensors from their safetensors files into new CPU tensors, on a few threads.

    Args:
        infos: where each tensor is.
        dtypes: the dtype each result should have (default: as stored); a different one is cast.
        view: gives a CPU view of a tensor's bytes in the file (a memory map) to cast from, or
            ``None`` when it has none (the tensor is then read in its stored dtype first).
        threads: how many threads copy (default :func:`copy_threads`).
        chunk_bytes: the most bytes one thread copies at a time.
        on_piece: called ``(tensor index, stored bytes)`` from a thread as chunks finish (progress).
        on_wait: called in the calling thread while the threads copy: whenever ``wake`` is
            set, and about every 0.1 s (draws progress).
        wake: an event the progress reports set, so that ``on_wait`` runs at once.

    Returns:
        The tensors, in the order of ``infos``; every copy has finished.

    Raises:
        CheckpointError: a file was removed, or ends before one of its tensors does.

    Example:
        >>> import tempfile, safetensors.torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(5.0)}, path)
        >>> copy_to_cpu([SafetensorsFile(path).tensors["w"]], [torch.float16], chunk_bytes=4)
        [tensor([0., 1., 2., 3., 4.], dtype=torch.float16)]
    """
    dtypes = [i.dtype for i in infos] if dtypes is None else list(dtypes)
    files = FileDescriptors(infos)
    try:
        sources = [None if d == i.dtype else _cast_source(i, view) for i, d in zip(infos, dtypes)]
        outs = [torch.empty(i.shape, dtype=d) for i, d in zip(infos, dtypes)]
        jobs = _chunk_jobs(infos, outs, sources, files, chunk_bytes, on_piece)
        _run(jobs, min(threads or copy_threads(), len(jobs)), on_wait, wake)
    finally:
        files.close()
    return outs


def _cast_source(info: TensorInfo, view: Callable[[TensorInfo], torch.Tensor | None] | None) -> torch.Tensor:
    """What a cast reads from: the file's mapped bytes, or (no view possible) a stored-dtype copy."""
    mapped = view(info) if view is not None and info.nbytes > 0 else None
    return mapped if mapped is not None else read_tensor(info)


def _run(jobs: list[Callable[[], None]], threads: int, on_wait: Callable[[], None] | None = None,
         wake: threading.Event | None = None) -> None:
    """Run every job; the first error (or an interrupt) cancels the jobs not yet started and is
    raised once the running ones have stopped."""
    if threads <= 1:
        for job in jobs:
            job()
            if on_wait is not None:
                on_wait()
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="nbaccel-copy")
    try:
        futures = [pool.submit(job) for job in jobs]
        wait_all(futures, on_wait, wake)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    error = next((e for f in futures if not f.cancelled() and (e := f.exception()) is not None), None)
    if error is not None:
        raise error
