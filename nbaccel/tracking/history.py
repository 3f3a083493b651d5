"""The launching side of the notebook tracker: the logged records of a launch, kept as they arrive.

The supervisor keeps every ``log`` frame from a worker in the run's
:class:`~nbaccel.launch.run_log.RunLog` and hands each record to the status panel's live chart;
the helpers here are the chart's views of the records. After the launch (or while it runs, from
another thread), :func:`last_run_history` returns them as a list of dicts, one per ``accelerator.log``
call, each with its ``step`` (ready for ``pandas.DataFrame(...)``).

This is one record per process: the latest launch's history replaces the one before it.
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.run_log import last_run_log

__all__ = ["last_run_history", "metric_names", "metrics_table", "series"]


def metric_names(records: list[dict[str, Any]]) -> list[str]:
    """The keys with numeric values in ``records``, first-seen order (``step`` and ``time`` excluded)."""
    names: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                names.setdefault(key, None)
    return list(names)


def series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of metric ``name`` in ``records``."""
    pairs = [(r["step"], float(r[name])) for r in records if isinstance(r.get(name), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def metrics_table(records: list[dict[str, Any]], rows: int = 5) -> str:
    """The last ``rows`` records as a compact text table (the no-widget view of the live chart).

    Example:
        >>> print(metrics_table([{"step": 0, "time": 0, "loss": 1.0}, {"step": 1, "time": 0, "loss": 0.5}]))
        step      loss
           0         1
           1       0.5
    """
    names = metric_names(records)
    if not names:
        return ""
    head = "step" + "".join(f"{n[:12]:>14}" if len(n) > 8 else f"{n:>10}" for n in names)
    lines = [head]
    for record in records[-rows:]:
        cells = []
        for name in names:
            value = record.get(name)
            text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
            cells.append(f"{text:>14}" if len(name) > 8 else f"{text:>10}")
        lines.append(f"{record['step']:>4}" + "".join(cells))
    return "\n".join(lines)


def last_run_history() -> list[dict[str, Any]]:
    """What the latest launch's workers passed to ``accelerator.log`` (main process), one dict per call.

    Each dict has ``step`` (the ``step=`` given, else the call count), ``time`` (seconds since
    the epoch, when it was logged) and the logged values (tensors made numbers, nested dicts
    flattened to ``"a/b"``). Empty before any launch, or when nothing was logged.

    Example:
        >>> notebook_launcher(train, num_processes=2)   # doctest: +SKIP
        >>> import pandas; pandas.DataFrame(nbaccel.last_run_history()).plot(x="step", y="loss")   # doctest: +SKIP
    """
    log = last_run_log()
    return log.snapshot() if log is not None else []
