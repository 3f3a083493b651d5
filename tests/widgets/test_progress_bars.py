"""tqdm in a worker: each rank's bar shows in the status panel as a bar of its own."""

from __future__ import annotations

import sys

from nbaccel import notebook_launcher
from nbaccel.launch.output import OutputRelay
from nbaccel.widgets.status_panel import StatusPanel, TextStatus


def _with_a_bar(total: int) -> int:
    import os
    import time

    from tqdm.std import tqdm

    for _ in tqdm(range(total), desc=f"rank {os.environ['RANK']}", file=sys.stderr, mininterval=0, ncols=60):
        time.sleep(0.01)  # redraws apart in time, as in real work: not all read in one chunk (then coalesced)
    return total


def test_each_ranks_tqdm_bar_is_its_own_bar_in_the_panel():
    panel = StatusPanel(2, interval=10.0)
    notebook_launcher(_with_a_bar, (20,), num_processes=2, use_cpu=True, observer=panel)
    for rank in (0, 1):
        assert panel.records[rank].progress.startswith(f"rank {rank}: 100%") and "20/20" in panel.records[rank].progress
    table = panel._table_html()
    assert table.count("<progress class='nbaccel-progress' value='1.000'") == 2 and ">progress</th>" in table
    assert "progress: rank 1: 100%" in panel.text()


def test_no_progress_column_without_a_bar():
    panel = TextStatus(1)
    notebook_launcher(print, ("no bar",), num_processes=1, use_cpu=True, observer=panel)
    assert panel.records[0].progress == "" and "progress:" not in panel.text()


def test_the_relay_reports_every_redraw_and_the_final_state(capsys):
    seen = []
    relay = OutputRelay(on_progress=lambda rank, stream, text: seen.append((rank, text)))
    relay.feed(1, "stderr", b"\r 10%|#")
    relay.feed(1, "stderr", b"\r 50%|#####\r100%|##########\n")
    assert seen == [(1, " 10%|#"), (1, "100%|##########")]  # the last state, once its line ends
    assert "[rank1]: 100%|##########" in capsys.readouterr().out  # a bar ends as progress, not as stderr


def test_with_the_panel_the_stream_gets_each_bars_final_line_only(capfd):
    panel = StatusPanel(2, interval=10.0)
    notebook_launcher(_with_a_bar, (20,), num_processes=2, use_cpu=True, observer=panel)
    out, err = capfd.readouterr()
    relayed = [line for line in out.splitlines() if line.startswith("[rank")]  # not the panel's own text form
    assert out.count("\r") == 0 and sum("20/20" in line for line in relayed) == 2  # one final line per rank
    assert "20/20" not in err  # the bars end as progress (stdout), not as stderr
    notebook_launcher(_with_a_bar, (20,), num_processes=2, use_cpu=True, observer=TextStatus(2))
    assert capfd.readouterr().out.count("\r") > 2  # without the panel the bars redraw in the stream, as before
