"""The DDP imports (torch._dynamo): made before a fork when the function builds a model, never for a trivial one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from nbaccel.launch.warmup import may_build_ddp, source_names
from nbaccel.tracebacks import clean_traceback

FRESH = """
    import sys
    import torch
    from nbaccel import notebook_launcher

    def trivial():
        return 1

    def trains():
        had = "torch._dynamo" in sys.modules  # before this worker built anything
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        model = DistributedDataParallel(torch.nn.Linear(2, 2))
        model(torch.ones(1, 2)).sum().backward()
        del model
        return had

    which = sys.argv[1]
    if which == "trivial":
        print("RESULT", notebook_launcher(trivial, num_processes=2), "torch._dynamo" in sys.modules)
    else:
        print("RESULT", notebook_launcher(trains, num_processes=2), "torch._dynamo" in sys.modules)
"""


def _fresh(tmp_path, which: str) -> str:
    script = tmp_path / "fresh.py"
    script.write_text(textwrap.dedent(FRESH))
    done = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split("RESULT ", 1)[1].strip()


def test_a_trivial_first_launch_does_not_import_dynamo(tmp_path):
    assert _fresh(tmp_path, "trivial") == "1 False"


def test_a_training_function_gets_dynamo_from_the_caller_before_the_fork(tmp_path):
    assert _fresh(tmp_path, "trains") == "True True"  # imported in the caller, so each worker had it already


def test_the_guess_reads_functions_and_the_functions_they_call():
    def helper():
        return DistributedDataParallel  # noqa: F821 - only its name matters

    def calls_helper():
        return helper()

    assert may_build_ddp(calls_helper) and not may_build_ddp(lambda: 1)
    assert not may_build_ddp(names=source_names("from nbaccel import Accelerator\nacc = Accelerator()"))
    assert may_build_ddp(names=source_names("acc = Accelerator()\nmodel = acc.prepare(model)"))
    assert not may_build_ddp(names=source_names("print('hello')")) and source_names("def (") == set()
    # a cell that calls a notebook function: the function is read too
    assert may_build_ddp(names=source_names("train(3)"), namespace={"train": calls_helper, "x": 1})
    assert not may_build_ddp(names=source_names("x + 1"), namespace={"train": calls_helper, "x": 1})


def test_one_trimmer_drops_the_launchers_frames_everywhere():
    text = ('Traceback (most recent call last):\n'
            '  File "<frozen runpy>", line 88, in _run_code\n'
            '  File "/x/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 3, in w\n'
            '    return f(*args, **kwargs)\n'
            '  File "/home/me/train.py", line 4, in <module>\n'
            '    main()\n'
            '  File "cell-7", line 2, in main\n'
            '    1 / 0\n'
            'ZeroDivisionError: division by zero')
    assert clean_traceback(text, {"cell-7": 5}).splitlines() == [
        "Traceback (most recent call last):", '  File "/home/me/train.py", line 4, in <module>', "    main()",
        "  Cell In[5], line 2, in main", "    1 / 0", "ZeroDivisionError: division by zero"]


def _entry_state() -> dict:
    import gc
    import sys

    state = {"imported": "nbaccel.training.accelerator" in sys.modules, "frozen": gc.get_freeze_count()}
    from nbaccel import Accelerator  # noqa: F401 - the name the launch saw, and imported before forking
    return state


def test_forked_workers_find_the_nbaccel_names_they_use_imported_and_the_callers_objects_frozen():
    """Imported once in the caller, frozen for the workers' collections, unfrozen again in the caller."""
    import gc
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, json, sys
        from nbaccel import notebook_launcher
        from tests.launch.test_warmup import _entry_state
        before = "nbaccel.training.accelerator" in sys.modules
        state = notebook_launcher(_entry_state, num_processes=2, use_cpu=True, start_method="fork")
        print(json.dumps([before, state, gc.get_freeze_count()]))
    """)
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    import json

    before, state, caller_frozen = json.loads(done.stdout.strip().splitlines()[-1])
    assert before is False and state["imported"] is True
    assert state["frozen"] > 1000 and caller_frozen == 0
    assert gc.get_freeze_count() == 0


def test_the_used_names_are_imported_with_the_collector_held_off_and_left_as_it_was(tmp_path, monkeypatch):
    """A full collection in the caller walks every object it holds (70-80 ms with torch): none runs in the import."""
    import gc
    import sys

    from nbaccel.exports import EXPORTS
    from nbaccel.launch.warmup import import_used_exports

    (tmp_path / "nbaccel_probe_export.py").write_text(
        "cycles = []\nfor _ in range(50_000):\n    item = []\n    item.append(item)\n    cycles.append(item)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXPORTS, "ProbeExport", "nbaccel_probe_export")
    collections = []

    def note(phase, info):
        collections.append(info["generation"])

    gc.callbacks.append(note)
    try:
        for enabled in (True, False):
            sys.modules.pop("nbaccel_probe_export", None)
            (gc.enable if enabled else gc.disable)()
            import_used_exports(["ProbeExport"])
            assert "nbaccel_probe_export" in sys.modules and collections == []
            assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(note)
        gc.enable()
        sys.modules.pop("nbaccel_probe_export", None)
