"""Fault matrix, round two, output rows: what a rank writes costs the caller what it is worth, no more.

Megabytes of ``\\r`` redraws with no newline keep only the bar's last state; a line longer than
the cap is cut in the cell, which names the rank's log file, and the file holds the whole line;
a burst of lines is flushed to the caller's stream a bounded number of times, not once per line;
a finished progress bar ends on stdout, not stderr; and the pending line the relay holds never
grows past the cap, whatever arrives.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

from nbaccel import notebook_launcher
from nbaccel.launch.output import FLUSH_INTERVAL, OutputRelay
from nbaccel.launch.output_log import MAX_LINE_CHARS


def _redraws_then_a_line(megabytes: int) -> int:
    import os

    state = 0
    chunk = []
    for state in range(megabytes * (1 << 20) // 10):
        chunk.append(f"\r{state:9d}")
        if len(chunk) == 10_000:
            os.write(2, "".join(chunk).encode())  # as tqdm does: to stderr, never a newline
            chunk = []
    os.write(2, ("".join(chunk) + "\n").encode())
    print("after the bar", flush=True)
    return state


def test_megabytes_of_redraws_show_only_the_bars_last_state(capfd):
    last = notebook_launcher(_redraws_then_a_line, (20,), num_processes=2)
    out, err = capfd.readouterr()
    assert f"[rank0]: {last:9d}\n" in out and f"[rank1]: {last:9d}\n" in out  # the final state, on stdout
    assert "after the bar" in out and str(last) not in err
    assert len(out) < 2 * (1 << 20)  # one redraw per read at most, not 40 MB re-copied


def _a_long_line(chars: int) -> None:
    import os

    if os.environ["RANK"] == "1":
        body = "".join(chr(ord("a") + i % 26) for i in range(chars))
        for start in range(0, chars, 65536):  # in pieces, as a slow writer would
            os.write(1, body[start:start + 65536].encode())
        os.write(1, b"\n")
    print("short line", flush=True)


def test_a_long_line_is_cut_in_the_cell_and_kept_whole_in_the_ranks_log(capfd):
    chars = 3_000_000
    notebook_launcher(_a_long_line, (chars,), num_processes=2)
    out = capfd.readouterr().out
    cut = next(line for line in out.splitlines() if line.startswith("[rank1]: abc"))
    assert len(cut) < MAX_LINE_CHARS + 300 and f"line cut at {MAX_LINE_CHARS:,} of {chars:,} characters" in cut
    log = Path(cut.rsplit("the whole line is in ", 1)[1].rstrip("]"))
    assert log.name == "rank1.log"
    assert log.read_text() == "".join(chr(ord("a") + i % 26) for i in range(chars)) + "\n"
    assert "[rank0]: short line" in out and "[rank1]: short line" in out
    log.unlink()
    log.parent.rmdir()


def test_the_relay_holds_at_most_one_capped_line_whatever_arrives():
    relay = OutputRelay()
    sink = io.StringIO()
    stdout, sys.stdout = sys.stdout, sink
    try:
        for i in range(2000):  # 2000 reads of 1000 redraws each, and no newline
            relay.feed(0, "stdout", "".join(f"\r{i:05d}-{j:04d}" for j in range(1000)).encode())
            assert len(relay._states[(0, "stdout")].pending) <= MAX_LINE_CHARS + 2
        relay.feed(0, "stdout", b"x" * (5 * MAX_LINE_CHARS))  # the bar goes on, longer than the cap
        relay.flush_rank(0)
    finally:
        sys.stdout = stdout
    # the bar's last state, capped like any line (a bar's state is redrawn, so nothing is logged)
    assert sink.getvalue().endswith(f"\r[rank0]: 01999-0999{'x' * (MAX_LINE_CHARS - 10)}\n")
    assert sink.getvalue().count("\n") == 1


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_a_burst_of_lines_is_flushed_a_bounded_number_of_times():
    relay = OutputRelay()
    sink = _CountingStream()
    stdout, sys.stdout = sys.stdout, sink
    started = time.monotonic()
    try:
        for i in range(20_000):  # one read per line: the worst case
            relay.feed(i % 2, "stdout", f"line {i}\n".encode())
        relay.flush()
    finally:
        sys.stdout = stdout
    elapsed = time.monotonic() - started
    assert sink.getvalue().count("\n") == 20_000 and "[rank1]: line 19999\n" in sink.getvalue()
    # at most one flush per FLUSH_INTERVAL while lines pour in, plus the final one: not one per line
    assert sink.flushes <= elapsed / FLUSH_INTERVAL + 2 < 20_000
