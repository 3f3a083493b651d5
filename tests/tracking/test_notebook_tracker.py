"""The notebook tracker: accelerator.log in a worker reaches the launching process, its history, and the panel."""

from __future__ import annotations

import time

import pytest

import nbaccel
from nbaccel import notebook_launcher
from nbaccel.tracking import LoggerType
from nbaccel.widgets.status_panel import StatusPanel, TextStatus


def _log_steps(steps: int = 5, pause: float = 0.0, init: bool = False) -> list:
    accelerator = nbaccel.Accelerator()
    if init:
        accelerator.init_trackers("demo", config={"lr": 0.1})
    for step in range(steps):
        accelerator.log({"loss": 1.0 / (step + 1), "acc": {"train": step / 10}}, step=step * 10)
        time.sleep(pause)
    sent = accelerator.get_tracker("notebook", unwrap=True)  # started by init_trackers, or by the first log
    accelerator.end_training()
    return [str(t) for t in accelerator.log_with], [r["step"] for r in sent] if accelerator.is_main_process else sent


@pytest.mark.slow
def test_logged_values_reach_the_launching_process_from_the_main_rank_only():
    results = notebook_launcher(_log_steps, (4,), num_processes=2, use_cpu=True, return_all=True)
    assert results[0][0] == results[1][0] == ["notebook"]  # on by default inside a launch
    assert results[0][1] == [0, 10, 20, 30]
    assert not hasattr(results[1][1], "name")  # elsewhere: a blank tracker, as in Accelerate
    history = nbaccel.last_run_history()
    assert [r["step"] for r in history] == [0, 10, 20, 30]  # rank 1's calls were not sent: main process only
    assert [r["loss"] for r in history] == [1.0, 0.5, 1 / 3, 0.25]
    assert history[1]["acc/train"] == 0.1 and isinstance(history[0]["time"], float)


def test_init_trackers_sends_the_project_and_keeps_a_copy_in_the_worker():
    _log_with, sent_steps = notebook_launcher(_log_steps, (3, 0.0, True), num_processes=1, use_cpu=True)
    assert sent_steps == [0, 10, 20]  # get_tracker("notebook", unwrap=True): what -o can bring back
    assert [r["step"] for r in nbaccel.last_run_history()] == [0, 10, 20]


def _no_notebook() -> list:
    accelerator = nbaccel.Accelerator(notebook_tracker=False)
    accelerator.log({"loss": 1.0}, step=0)
    return accelerator.log_with


def test_off_when_asked_and_outside_a_launch():
    assert notebook_launcher(_no_notebook, num_processes=1, use_cpu=True) == []
    assert nbaccel.last_run_history() == []
    assert LoggerType.NOTEBOOK not in nbaccel.Accelerator().log_with  # the notebook itself: nothing to send to


def test_panel_draws_a_live_chart_while_the_launch_runs_and_keeps_it_as_an_image():
    panel = StatusPanel(2, interval=0.05, chart_interval=0.3)
    panel.chart.cpu_share = 1.0  # only chart_interval limits redraws here (the CPU rule is tested below)
    pngs = []
    original = panel.chart.update

    def watch(records, title="", *, force=False):
        drawn = original(records, title, force=force)
        if drawn and panel.ok is None:
            pngs.append((len(records), panel.chart.png))
        return drawn

    panel.chart.update = watch  # type: ignore[method-assign]  # watched on purpose
    notebook_launcher(_log_steps, (30, 0.1), num_processes=2, use_cpu=True, observer=panel)
    assert len(pngs) >= 2 and pngs[0][0] < 30  # redrawn during the run, with the records so far
    assert pngs[0][1] != pngs[-1][1] and pngs[0][0] < pngs[-1][0]  # the chart grew
    assert panel.chart.draws <= 1 + 30 * 0.1 / 0.3 + 2  # rate-limited: not one redraw per record
    assert panel.chart.png.startswith(b"\x89PNG") and panel.chart.drawn_count == 30
    bundle = panel._repr_mimebundle_()
    assert "image/png" in bundle and "application/vnd.jupyter.widget-view+json" in bundle
    assert "loss" in bundle["text/plain"] and "acc/train" in bundle["text/plain"]


def test_text_fallback_prints_a_compact_table_every_few_seconds(capsys):
    status = TextStatus(2, metrics_interval=0.3)
    notebook_launcher(_log_steps, (8, 0.1), num_processes=2, use_cpu=True, observer=status)
    out = capsys.readouterr().out
    assert out.count("[logged, ") >= 1  # printed while it ran
    summary = out[out.index("nbaccel launch, fork: finished"):]
    assert "logged (8 records, last 5)" in summary and "loss" in summary and "acc/train" in summary


def test_a_slow_redraw_waits_longer_before_the_next():
    import ipywidgets

    from nbaccel.widgets.live_chart import LiveChart

    chart = LiveChart(ipywidgets, min_interval=0.0, cpu_share=0.05)
    records = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(50)]
    assert chart.update(records[:10])  # builds the figure: not counted as a redraw's cost
    assert chart.update(records[:20])  # a real redraw, timed
    assert not chart.update(records[:30])  # within 20x that redraw's time: skipped
    assert chart.update(records, force=True) and chart.drawn_count == 50 and chart.draws == 3
