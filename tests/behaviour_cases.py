"""What a user sees from a run, asserted the same way for every way of running it (issue 26).

A one-shot launch, a warm pool, a warm one-process rank, on this machine or on Ray: each test
file defines only its variants, as a module-scoped fixture ``runner`` giving a :class:`Variant`,
and imports the behaviour tests below with ``from tests.behaviour_cases import *`` (``__all__``:
the tests and the ``published`` fixture). This module's name does not start with ``test_``, so
pytest collects its tests only where a variant file imports them: once per variant file.

The functions the ranks run live here, at module level, so spawned workers and Ray actors import
them by reference. Where variants differ on purpose (a pool keeps what a run leaves; a launch
starts afresh), the variant says so (:attr:`Variant.keeps_state`, :attr:`Variant.forks_caller`)
and the test asserts the variant's own promise.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import nbaccel
from nbaccel import LaunchTimeoutError, WorkerFailedError
from tests.pool.helpers import wait_for as wait_until

WAIT = 30.0
"""Seconds any wait in these tests may take: generous, for a machine shared with other suites."""


# ---------------------------------------------------------------------------- the variants
class Variant:
    """One way of running a function on ranks; the test files subclass it.

    Attributes:
        name: the pytest id.
        num_processes: ranks per run.
        keeps_state: what a run leaves in its ranks (modules, ``worker_namespace()``, nbaccel's
            state) is there for the next run, on purpose (a pool).
        forks_caller: each run starts from a copy of the caller (its RNG state included).
        keeps_modules: what a run changes in imported modules' globals stays for the next run (a
            pool; the warm one-process rank, as documented in ``nbaccel.launch.pool.warm``).
    """

    name = ""
    num_processes = 2
    keeps_state = False
    forks_caller = True
    keeps_modules = False

    def run(self, function: Callable[..., Any], *args: Any, observer: Any = None, return_all: bool = False,
            output_ranks: list[int] | None = None) -> Any:
        """Run ``function(*args)`` on every rank; rank 0's value, or ``{rank: value}`` with ``return_all``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def with_timeout(self, seconds: float) -> Iterator[Variant]:
        """This variant with runs cancelled after ``seconds`` (a pool: a pool made with ``timeout=``)."""
        raise NotImplementedError
        yield self

    def check_after_interrupt(self, pids: list[int]) -> None:
        """Assert what this variant promises once an interrupted run has raised (``pids``: the ranks that ran)."""


class Recorder:
    """An observer that keeps every event, and touches ``seen_file`` at the first ``on_log``."""

    def __init__(self, seen_file: str | None = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.seen_file = seen_file

    def on_launch(self, ranks: Any, start_method: str) -> None:
        self.events.append(("launch", list(ranks)))

    def on_state(self, rank: int, state: str) -> None:
        self.events.append(("state", rank, state))

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.events.append(("output", rank, stream, line))

    def on_progress(self, rank: int, stream: str, text: str) -> None:
        self.events.append(("progress", rank, text))

    def on_log(self, rank: int, record: dict[str, Any]) -> None:
        self.events.append(("log", rank, dict(record)))
        if self.seen_file is not None and not os.path.exists(self.seen_file):
            open(self.seen_file, "w").close()

    def on_end(self, ok: bool) -> None:
        self.events.append(("end", ok))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        """The events of ``kind``, without their kind."""
        return [e[1:] for e in self.events if e[0] == kind]


class PoolVariant(Variant):
    """A warm pool (local, or Ray's with ``backend="ray"``): the same ranks for every run, and what a run leaves
    stays."""

    keeps_state = True
    forks_caller = False
    keeps_modules = True

    def __init__(self, name: str, pool: nbaccel.WorkerPool) -> None:
        self.name, self.pool, self.num_processes = name, pool, pool.num_processes

    def run(self, function: Callable[..., Any], *args: Any, observer: Any = None, return_all: bool = False,
            output_ranks: list[int] | None = None) -> Any:
        if observer is None and output_ranks is None:  # the user's way
            return self.pool.run(function, *args, return_all=return_all)
        results = self.pool.launch(self.pool.request(function, args, observer=observer, return_all=return_all,
                                                     output_ranks=output_ranks))
        return results if return_all else results.get(0)

    @contextlib.contextmanager
    def with_timeout(self, seconds: float) -> Iterator[Variant]:
        backend = "ray" if self.pool.start_method == "ray" else "local"
        with nbaccel.WorkerPool(num_processes=self.num_processes, use_cpu=True, timeout=seconds,
                                backend=backend) as timed:
            yield PoolVariant(self.name, timed)

    def check_after_interrupt(self, pids: list[int]) -> None:
        assert self.pool.alive and sorted(self.pool.pids) == sorted(pids)  # the same ranks, still up


# ---------------------------------------------------------------------------- what the ranks run
def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    return wait_until(predicate, timeout)


def answer() -> int:
    return 42


def talk() -> int:
    r = rank()
    print(f"one {r}", flush=True)
    print(f"err {r}", file=sys.stderr, flush=True)
    os.write(1, f"fd {r}\n".encode())  # C code and child processes write to the descriptor
    print(f"two {r}")
    sys.stdout.write(f"partial {r}")  # no newline, no flush: the run's end must bring it out
    return r


def show_between_lines() -> None:
    from IPython.display import HTML, display

    r = rank()
    print(f"before {r}", flush=True)
    display(HTML(f"<b>shown by {r}</b>"))
    print(f"after {r}", flush=True)


def draw_on_rank_0() -> None:
    if rank() == 0:
        import matplotlib.pyplot as plt

        plt.plot([1, 2, 3])
        plt.show()
    print(f"drawn {rank()}", flush=True)


def draw_everywhere() -> None:
    import matplotlib.pyplot as plt

    plt.plot([1, rank()])
    plt.show()


def log_values(values: list[float], seen_file: str | None) -> bool | None:
    """Log ``values`` (steps 0, 10, ...); with ``seen_file``, wait (on the main rank) until the caller has seen one."""
    from nbaccel import Accelerator

    accelerator = Accelerator()
    seen = None
    for i, value in enumerate(values):
        accelerator.log({"loss": value}, step=10 * i)
        if i == 1 and seen_file is not None and accelerator.is_main_process:
            seen = wait_for(lambda: os.path.exists(seen_file), 10.0)  # the live chart draws while the run runs
        time.sleep(0.3)  # longer than the channel's 0.2 s batching: the next log sends this one
    accelerator.end_training()
    return seen


def with_a_bar(total: int) -> int:
    from tqdm.std import tqdm

    for _ in tqdm(range(total), desc=f"rank {rank()}", file=sys.stderr, mininterval=0, ncols=60):
        time.sleep(0.01)
    return total


def fail_on_last_rank(last: int) -> str:
    if rank() == last:
        raise KeyError("x")
    return "fine"


def sleep_in_steps(marker_dir: str, seconds: float = 60.0) -> None:
    """Sleep in short steps (Python code between native calls, as a training loop is); markers say where it got."""
    r = rank()
    with open(os.path.join(marker_dir, f"running-{r}"), "w") as f:
        f.write(str(os.getpid()))
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        open(os.path.join(marker_dir, f"cancelled-{r}"), "w").close()
        raise


def remember_in_namespace(key: str, value: str) -> None:
    nbaccel.worker_namespace()[key] = value


def recall_from_namespace(key: str) -> str | None:
    return nbaccel.worker_namespace().get(key)


LEFT_BY_A_RUN: str | None = None


def leave_in_process(value: str) -> None:
    global LEFT_BY_A_RUN
    LEFT_BY_A_RUN = value
    os.environ["NBACCEL_TEST_LEFT_BY_A_RUN"] = value


def read_process_leftovers() -> tuple[str | None, str | None]:
    return LEFT_BY_A_RUN, os.environ.get("NBACCEL_TEST_LEFT_BY_A_RUN")


def set_cell_global(value: str) -> None:
    global cell_value
    cell_value = value


def get_cell_global() -> str | None:
    return globals().get("cell_value")


def cell_functions() -> dict[str, Callable[..., Any]]:
    """:func:`set_cell_global` and :func:`get_cell_global` as a notebook cell defines them: in ``__main__``.

    Their globals are the cell's namespace, not this module's, so they travel by value (as a
    notebook's functions do) and ``global`` writes into that namespace.
    """
    namespace: dict[str, Any] = {"__name__": "__main__"}
    return {f.__name__: types.FunctionType(f.__code__, namespace, f.__name__)
            for f in (set_cell_global, get_cell_global)}


def make_accelerator() -> bool:
    from nbaccel import Accelerator
    from nbaccel.state import is_initialized

    Accelerator()
    return is_initialized()


def state_initialized() -> bool:
    from nbaccel.state import is_initialized

    return is_initialized()


def draw_random() -> tuple[float, float]:
    import numpy
    import torch

    return torch.rand(1).item(), float(numpy.random.rand())


# ---------------------------------------------------------------------------- the caller's cell
class _CellPublisher:
    """Stands in for the notebook's display publisher: keeps each bundle and marks it in stdout, in order."""

    def __init__(self) -> None:
        self.bundles: list[dict[str, Any]] = []

    def publish(self, data: dict[str, Any], metadata: Any = None, source: Any = None, *, transient: Any = None,
                update: bool = False, **kwargs: Any) -> None:
        self.bundles.append(dict(data))
        sys.stdout.write(f"<published {str(data.get('text/html') or sorted(data))[:80]}>\n")
        sys.stdout.flush()


def kernel_like_shell() -> Any:
    """The in-process IPython shell (started once per process), formatting every type as a kernel's does.

    A terminal shell formats text only. Left so for the session, not undone after a test: ranks
    forked later (a warm rank, a pool) copy the caller's formatter, as they would copy a kernel's.
    The variant files call it before they start a pool or a warm rank.
    """
    from IPython.core.formatters import DisplayFormatter
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.display_formatter.active_types = DisplayFormatter().active_types
    return shell


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> _CellPublisher:
    """The displays published in the caller, as an in-process IPython shell (a kernel's stand-in) receives them."""
    from IPython.core.displaypub import DisplayPublisher

    shell = kernel_like_shell()
    recorder = _CellPublisher()

    class Publisher(DisplayPublisher):
        def publish(self, *args: Any, **kwargs: Any) -> None:
            recorder.publish(*args, **kwargs)

    monkeypatch.setattr(shell, "display_pub", Publisher(shell=shell))
    return recorder


def _png_bytes(png: bytes | str) -> bytes:
    return png if isinstance(png, bytes) else base64.b64decode(png)


def _labelled(text: str, r: int) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"[rank{r}]")]


# ---------------------------------------------------------------------------- the behaviours
def test_output_reaches_the_caller_labelled_in_order(runner, capfd):
    assert runner.run(talk, return_all=True) == {r: r for r in range(runner.num_processes)}
    out, err = capfd.readouterr()
    for r in range(runner.num_processes):
        assert _labelled(out, r) == [f"[rank{r}]: one {r}", f"[rank{r}]: fd {r}", f"[rank{r}]: two {r}",
                                     f"[rank{r}]: partial {r}"], out
        assert _labelled(err, r) == [f"[rank{r}]: err {r}"], err


def test_displays_are_published_in_the_caller_between_the_printed_lines(runner, capfd, published):
    runner.run(show_between_lines)
    out, _ = capfd.readouterr()
    shown = [line for line in out.splitlines() if line.startswith(("[rank0]", "<published"))]
    assert shown == ["[rank0]: before 0", "<published <b>shown by 0</b>>", "[rank0]: after 0"], out
    assert [b.get("text/html") for b in published.bundles] == ["<b>shown by 0</b>"]  # rank 0's only, by default


def test_a_figure_shown_on_rank_0_is_published_as_a_png(runner, capfd, published):
    runner.run(draw_on_rank_0)
    images = [b for b in published.bundles if "image/png" in b]
    assert len(images) == 1, published.bundles
    assert _png_bytes(images[0]["image/png"]).startswith(b"\x89PNG")  # bytes: a kernel sends them as base64
    assert "Figure" in images[0]["text/plain"]
    out, _ = capfd.readouterr()
    shown = [line for line in out.splitlines() if line.startswith(("[rank0]", "<published"))]
    assert shown[-1] == "[rank0]: drawn 0" and shown[0].startswith("<published"), out


def test_figures_of_several_ranks_are_published_each_labelled_with_its_rank(runner, published):
    if runner.num_processes < 2:
        pytest.skip("one rank: nothing to label")
    runner.run(draw_everywhere, output_ranks=[0, 1])
    images = sorted((b for b in published.bundles if "image/png" in b), key=lambda b: b["text/plain"])
    assert [b["text/plain"].split(":")[0] for b in images] == ["[rank0]", "[rank1]"], published.bundles
    for bundle in images:
        html = bundle["text/html"]
        assert html.count("<img") == 1 and 'src="data:image/png;base64,' in html
        encoded = html.split('src="data:image/png;base64,', 1)[1].split('"', 1)[0]
        assert base64.b64decode(encoded, validate=True).startswith(b"\x89PNG"), html[:200]  # an image a browser shows


def test_logged_values_reach_the_live_chart_during_the_run_and_the_history_after_it(runner, tmp_path):
    seen_file = str(tmp_path / "seen")
    chart = Recorder(seen_file=seen_file)
    seen_while_running = runner.run(log_values, [1.0, 0.5, 0.25], seen_file, observer=chart)
    logged = chart.of("log")
    assert [(r, record["step"], record["loss"]) for r, record in logged] == [(0, 0, 1.0), (0, 10, 0.5), (0, 20, 0.25)]
    assert seen_while_running is True  # the observer had a record while the function still ran
    assert [(h["step"], h["loss"]) for h in nbaccel.last_run_history()] == [(0, 1.0), (10, 0.5), (20, 0.25)]
    runner.run(log_values, [0.125], None)
    assert [(h["step"], h["loss"]) for h in nbaccel.last_run_history()] == [(0, 0.125)]  # the latest run's only


def test_progress_bars_reach_the_observer_and_end_as_one_line(runner, capfd):
    bars = Recorder()
    assert runner.run(with_a_bar, 20, observer=bars) == 20
    out, _ = capfd.readouterr()
    for r in range(runner.num_processes):
        texts = [text for rank_, text in bars.of("progress") if rank_ == r]
        assert len(texts) >= 2, bars.events  # redrawn while it ran, not only its final state
        assert texts[-1].startswith(f"rank {r}: 100%") and "20/20" in texts[-1], texts
        assert any(line.startswith(f"[rank{r}]: rank {r}: 100%") for line in out.replace("\r", "\n").splitlines()), out


def test_a_failing_rank_raises_its_own_exception_in_the_caller_and_the_next_run_works(runner):
    last = runner.num_processes - 1
    with pytest.raises(KeyError) as info:
        runner.run(fail_on_last_rank, last)
    assert isinstance(info.value, WorkerFailedError)
    root = info.value.failures[0]
    assert root.rank == last and "KeyError" in root.exc_type and "'x'" in root.message
    assert "fail_on_last_rank" in root.traceback and 'raise KeyError("x")' in root.traceback
    assert runner.run(answer) == 42


def test_an_interrupt_stops_the_run_and_the_next_run_works(runner, tmp_path):
    main = threading.get_ident()

    def interrupt_once_every_rank_runs() -> None:
        def running() -> int:
            return len([n for n in os.listdir(tmp_path) if n.startswith("running-")])

        if wait_for(lambda: running() == runner.num_processes, 60.0):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_once_every_rank_runs, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        runner.run(sleep_in_steps, str(tmp_path))
    pids = [int((tmp_path / f"running-{r}").read_text()) for r in range(runner.num_processes)]

    def stopped(r: int, p: int) -> bool:
        return (tmp_path / f"cancelled-{r}").exists() or not _alive(p)

    assert wait_for(lambda: all(stopped(r, p) for r, p in enumerate(pids)), 15.0), os.listdir(tmp_path)
    runner.check_after_interrupt(pids)
    assert runner.run(answer) == 42


def test_a_run_past_its_timeout_is_stopped_and_the_next_run_works(runner, tmp_path):
    with runner.with_timeout(2.5) as timed:
        with pytest.raises(LaunchTimeoutError) as info:
            timed.run(sleep_in_steps, str(tmp_path))
        assert info.value.reason == "timeout"
        assert timed.run(answer) == 42
    started = [r for r in range(runner.num_processes) if (tmp_path / f"running-{r}").exists()]
    for r in started:  # where each rank was when it was stopped (a rank still starting has no such frame)
        assert "sleep_in_steps" in info.value.stacks.get(r, ""), info.value.stacks


def test_worker_namespace_is_kept_only_by_a_pool(runner):
    key = f"kept-{os.getpid()}-{time.monotonic_ns()}"
    runner.run(remember_in_namespace, key, "yes")
    assert runner.run(recall_from_namespace, key, return_all=True) == \
        {r: ("yes" if runner.keeps_state else None) for r in range(runner.num_processes)}


def test_what_a_run_leaves_in_its_process_is_gone_unless_a_pool_keeps_it(runner):
    token = f"left-{time.monotonic_ns()}"
    runner.run(leave_in_process, token)
    module_global, environment = runner.run(read_process_leftovers)
    assert module_global == (token if runner.keeps_modules else None)  # a pool's workers keep their modules
    assert environment == (token if runner.keeps_state else None)


def test_a_notebook_global_set_by_one_run_is_not_seen_by_the_next(runner):
    if runner.keeps_state:
        pytest.skip("a pool promises only worker_namespace() and imported modules between runs")
    cell = cell_functions()
    runner.run(cell["set_cell_global"], "from the first run")
    assert runner.run(cell["get_cell_global"]) is None


def test_nbaccel_state_made_in_one_run_is_reset_for_the_next_unless_a_pool_keeps_it(runner):
    assert runner.run(make_accelerator) is True
    assert runner.run(state_initialized) is runner.keeps_state  # a pool keeps its group and state on purpose


def test_a_run_draws_the_random_numbers_the_caller_would_draw_next(runner):
    if not runner.forks_caller:
        pytest.skip("this variant's ranks are not copies of the caller (a pool's, Ray's), so its RNG is their own")
    import numpy
    import torch

    # Python's own `random` is left out: CPython reseeds it in every forked child.
    torch.manual_seed(1234)
    numpy.random.seed(1234)
    torch_state, numpy_state = torch.get_rng_state(), numpy.random.get_state()
    expected = (torch.rand(1).item(), float(numpy.random.rand()))
    torch.set_rng_state(torch_state)
    numpy.random.set_state(numpy_state)
    assert runner.run(draw_random) == expected
    assert runner.run(draw_random) == expected  # the caller drew nothing in between: the same again


def _alive(p: int) -> bool:
    from tests.launch.procs import alive

    return alive(p)


__all__ = [  # what a variant file imports with `import *`: the behaviours and their fixture
    "published",
    "test_a_failing_rank_raises_its_own_exception_in_the_caller_and_the_next_run_works",
    "test_a_figure_shown_on_rank_0_is_published_as_a_png",
    "test_a_notebook_global_set_by_one_run_is_not_seen_by_the_next",
    "test_a_run_draws_the_random_numbers_the_caller_would_draw_next",
    "test_a_run_past_its_timeout_is_stopped_and_the_next_run_works",
    "test_an_interrupt_stops_the_run_and_the_next_run_works",
    "test_displays_are_published_in_the_caller_between_the_printed_lines",
    "test_figures_of_several_ranks_are_published_each_labelled_with_its_rank",
    "test_logged_values_reach_the_live_chart_during_the_run_and_the_history_after_it",
    "test_nbaccel_state_made_in_one_run_is_reset_for_the_next_unless_a_pool_keeps_it",
    "test_output_reaches_the_caller_labelled_in_order",
    "test_progress_bars_reach_the_observer_and_end_as_one_line",
    "test_what_a_run_leaves_in_its_process_is_gone_unless_a_pool_keeps_it",
    "test_worker_namespace_is_kept_only_by_a_pool",
]
if sorted(n for n in dict(globals()) if n.startswith("test_")) != [n for n in __all__ if n.startswith("test_")]:
    raise ImportError("tests/behaviour_cases.py: a behaviour test is missing from __all__ (no variant would run it)")
