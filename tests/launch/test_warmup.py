"""The DDP imports (torch._dynamo): made before a fork when the function builds a model, never for a trivial one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from nbaccel.tracebacks import clean_traceback
from nbaccel.launch.warmup import may_build_ddp, source_names

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
    assert may_build_ddp(names=source_names("from nbaccel import Accelerator\nacc = Accelerator()"))
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
