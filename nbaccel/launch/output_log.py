"""Where a rank's over-long lines go whole: one log file per rank and launch, made on first use.

The cell shows at most :data:`MAX_LINE_CHARS` characters of a line (a notebook renders a 100 MB
line as slowly as 100 MB of lines); the whole line is appended to ``rank<N>.log`` in a folder of
its own under the temporary directory, which the cell's shortened line names. The files are the
user's to read, so they outlive the launch (the temporary directory's cleanup removes them).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import IO

__all__ = ["MAX_LINE_CHARS", "RankLogs"]

MAX_LINE_CHARS = 10_000
"""The longest line (and progress-bar state) written to the cell; the rest goes to the rank's log."""


class RankLogs:
    """The per-rank log files of one launch (or one pool run), opened lazily.

    Example:
        >>> logs = RankLogs()
        >>> path = logs.append(0, "x" * 5)
        >>> Path(path).read_text()
        'xxxxx'
        >>> logs.close(); import shutil; shutil.rmtree(Path(path).parent)
    """

    def __init__(self) -> None:
        self._folder: Path | None = None
        self._files: dict[int, IO[str]] = {}

    def _file(self, rank: int) -> IO[str]:
        handle = self._files.get(rank)
        if handle is None:
            if self._folder is None:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                self._folder = Path(tempfile.mkdtemp(prefix=f"nbaccel-output-{stamp}-"))  # 0700
            handle = self._files[rank] = open(  # noqa: SIM115 - kept open across writes, closed by close()
                self._folder / f"rank{rank}.log", "a", encoding="utf-8", errors="replace")
        return handle

    def path(self, rank: int) -> str:
        """The log file of ``rank`` (created if it was not yet)."""
        return self._file(rank).name

    def append(self, rank: int, text: str) -> str:
        """Append ``text`` to ``rank``'s log; returns the file's path."""
        handle = self._file(rank)
        handle.write(text)
        handle.flush()  # readable while the launch runs: the cell already names the file
        return handle.name

    def close(self) -> None:
        """Close every open log file (they stay on disk)."""
        for handle in self._files.values():
            try:
                handle.close()
            except OSError:
                pass
        self._files.clear()

    def __del__(self) -> None:
        if os is not None:  # not during interpreter teardown
            self.close()
