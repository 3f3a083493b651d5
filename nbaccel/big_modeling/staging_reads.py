"""Reading one offloaded group's tensors from their files into staging, on every reader thread at once.

One ``preadv`` on one thread moves a few GB/s out of the page cache, far below a PCIe 5 bus, and
a group (a decoder layer) is a few hundred MiB: read whole by one thread, the next layer's
weights come late and the other readers idle. So each tensor's bytes are cut into pieces of
:data:`PIECE_BYTES`, and the pieces of every group being staged share one pool of reader
threads, taken in the order the groups were asked for (the next layer's pieces first).

What always holds: :meth:`SplitReads.read` returns once every byte asked is in place, or raises
the first error (a file cut short is a :class:`~nbaccel.errors.CheckpointError`) once the pieces
already running have stopped; pieces not yet started are dropped. An interrupt in the calling
thread does the same. The pool's threads only ever read (they never wait for one another), so
any number of callers can share it without deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from nbaccel.big_modeling.checkpoint_files import TensorInfo, read_into

__all__ = ["PIECE_BYTES", "SplitReads", "pieces"]

PIECE_BYTES = 4 * 2**20  # ~1 ms from the page cache: small enough to spread a layer over all readers


def pieces(nbytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges of at most ``piece_bytes`` covering ``nbytes``.

    Example:
        >>> pieces(10, 4)
        [(0, 4), (4, 8), (8, 10)]
    """
    return [(a, min(a + piece_bytes, nbytes)) for a in range(0, nbytes, max(1, piece_bytes))]


class SplitReads:
    """A pool of reader threads that fill staging buffers piece by piece.

    Args:
        readers: how many threads read.
        piece_bytes: the most bytes one read asks for.

    Example:
        >>> import tempfile, safetensors.torch, torch
        >>> from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
        >>> path = tempfile.mktemp(suffix=".safetensors")
        >>> safetensors.torch.save_file({"w": torch.arange(6.0)}, path)
        >>> out = torch.empty(6); reads = SplitReads(2, piece_bytes=8)
        >>> reads.read([(SafetensorsFile(path).tensors["w"], memoryview(out.numpy()).cast("B"))])
        >>> reads.close(); out.tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """

    def __init__(self, readers: int, piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = piece_bytes
        self.pool = ThreadPoolExecutor(max(1, readers), thread_name_prefix="nbaccel-offload-piece")

    def read(self, parts: Sequence[tuple[TensorInfo, memoryview]]) -> None:
        """Fill each view with its tensor's bytes (``len(view) == info.nbytes``), in pieces.

        Raises:
            CheckpointError: a file is gone or ends before its tensor does.
        """
        futures: list[Future] = []
        try:
            for info, view in parts:
                futures += [self.pool.submit(read_into, info, view[a:b], a)
                            for a, b in pieces(len(view), self.piece_bytes)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            error = next((e for f in done if (e := f.exception()) is not None), None)
            if error is not None:
                raise error
        finally:
            for future in futures:
                future.cancel()  # those not started; the running ones finish their one piece
            wait(futures)

    def close(self, wait: bool = True) -> None:
        """Stop the threads after the pieces in flight (``wait``: return once they have)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
