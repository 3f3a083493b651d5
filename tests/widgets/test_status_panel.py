"""The live status panel and its plain-text forms, driven by a real launch and by events."""

from __future__ import annotations

import sys

import pytest

from nbaccel import notebook_launcher
from nbaccel.errors import MissingDependencyError
from nbaccel.widgets.status_panel import (
    LaunchStatus,
    StatusPanel,
    TextStatus,
    status_observer,
)


def _work(lines: int) -> int:
    import os

    for i in range(lines):
        print(f"step {i}")
    if os.environ["RANK"] == "1":
        raise RuntimeError("diverged")
    return 0


def test_panel_follows_a_real_failed_launch():
    panel = StatusPanel(2, "test launch")
    with pytest.raises(RuntimeError, match="diverged"):
        notebook_launcher(_work, (3,), num_processes=2, observer=panel)
    states = {r: rec.state for r, rec in panel.records.items()}
    assert states[1] == "failed" and states[0] in ("finished", "stopped")
    assert panel.records[0].last_line == "step 2" and panel.records[0].line_count == 3
    assert "failed" in panel._heading.value
    failed = "<td style='padding:0 8px;white-space:nowrap;color:#dc2626;font-weight:bold'>failed</td>"
    assert failed in panel._table.value
    assert "step 0\nstep 1\nstep 2" in panel._outputs.children[0].value  # full output once it ended
    text = panel._repr_mimebundle_()["text/plain"]
    assert text.startswith("test launch, fork: failed after") and "[rank1] failed" in text


def test_redraws_are_batched_while_lines_pour_in():
    panel = StatusPanel(1, interval=10.0)
    draws = []
    panel._table.observe(lambda change: draws.append(change), names="value")
    LaunchStatus.on_launch(panel, [0], "fork")  # the record only: no display outside a kernel
    panel.on_state(0, "running")
    before = len(draws)
    for i in range(5000):
        panel.on_output(0, "stdout", f"line {i}")
    assert len(draws) - before <= 1
    assert panel.records[0].last_line == "line 4999" and panel.records[0].line_count == 5000
    panel.on_end(True)
    final = panel._outputs.children[0].value
    assert "... 3000 earlier lines not shown" in final and "line 4999" in final


def test_every_ranks_output_is_in_the_frontend_before_anyone_opens_it():
    # Opening a section is a message the kernel reads only after the cell: the text must be there already.
    panel = StatusPanel(2, interval=10.0)
    LaunchStatus.on_launch(panel, [0, 1], "fork")
    sent = {0: [], 1: []}
    for rank, child in panel._sections.items():
        child.observe(lambda change, rank=rank: sent[rank].append(change["new"]), names="value")
    for i in range(3):
        panel.on_output(0, "stdout", f"rank 0 step {i}")
    panel.on_output(1, "stderr", "rank 1 warning")
    panel.draw()  # what the ticker does while the launch runs
    assert panel._outputs.selected_index is None
    assert "rank 0 step 2" in panel._outputs.children[0].value
    assert "rank 1 warning" in panel._outputs.children[1].value
    panel.on_output(1, "stdout", "rank 1 step 0")
    panel.draw()
    assert len(sent[0]) == 1 and len(sent[1]) == 2  # only ranks with new lines are sent again
    panel.on_end(True)


def _silent() -> int:
    return 0


def test_a_silent_launch_has_no_output_sections():
    panel = StatusPanel(2, interval=10.0)
    notebook_launcher(_silent, num_processes=2, observer=panel)
    assert panel._outputs.children in ((), []) and "output (0 lines)" not in panel.text()


def test_lines_the_cell_stream_shows_are_not_repeated_in_the_panel(capsys):
    everyone = StatusPanel(2, interval=10.0, stream_ranks=None)  # what %%accel_launch -n 2 passes
    LaunchStatus.on_launch(everyone, [0, 1], "fork")
    for rank in (0, 1):
        everyone.on_output(rank, "stdout", f"rank {rank} step 0")
    everyone.on_end(True)
    assert everyone._outputs.children in ((), [])  # every line is in the cell already, once
    only_rank_0 = StatusPanel(2, interval=10.0, stream_ranks={0})  # %%accel_launch --ranks 0
    LaunchStatus.on_launch(only_rank_0, [0, 1], "fork")
    for rank in (0, 1):
        only_rank_0.on_output(rank, "stdout", f"rank {rank} step 0")
    only_rank_0.on_end(True)
    assert [c.value for c in only_rank_0._outputs.children] == [only_rank_0._sections[1].value]
    assert "rank 1 step 0" in only_rank_0._sections[1].value


def test_text_status_prints_the_summary_when_the_launch_ends(capsys):
    status = TextStatus(2, "plain")
    status.on_launch([0, 1], "spawn")
    status.on_state(0, "running")
    status.on_output(0, "stdout", "loss 0.5")
    status.on_output(0, "stdout", "   ")
    status.on_state(0, "finished")
    status.on_end(False)
    out = capsys.readouterr().out
    assert out.startswith("plain, spawn: stopped after")
    assert "[rank0] finished" in out and "last: loss 0.5" in out and "[rank1] stopped" in out


def test_without_ipywidgets_the_panel_says_how_to_install_and_text_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(MissingDependencyError, match="pip install ipywidgets") as info:
        StatusPanel(2)
    assert info.value.package == "ipywidgets"
    assert isinstance(status_observer(2), TextStatus)


def test_outside_a_notebook_the_observer_is_text():
    assert type(status_observer(2)) is TextStatus
    assert type(status_observer(2, prefer="text")) is TextStatus


def _slow() -> int:
    import time

    print("working")
    time.sleep(1.0)
    return 0


def test_ticker_draws_the_running_state_while_the_launch_runs():
    panel = StatusPanel(2, interval=0.1)
    tables: list[str] = []
    panel._table.observe(lambda change: tables.append(change["new"]), names="value")
    notebook_launcher(_slow, num_processes=2, observer=panel)
    running = [t for t in tables if ">running<" in t and "working" in t]
    assert running, "no redraw showed the ranks running"
    assert ">finished<" in tables[-1]
    assert panel._ticker is not None and not panel._ticker.is_alive()
