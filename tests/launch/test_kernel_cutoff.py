"""Workers forked from a real Jupyter kernel never use its channels: nothing from a worker on IOPub or the kernel's
stderr."""

from __future__ import annotations

import os
import queue
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def kernel(monkeypatch, tmp_path):
    """A kernel whose own stdout and stderr (what the Jupyter server would log) go to a file."""
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    log_path = tmp_path / "kernel.log"
    with open(log_path, "w") as log:
        km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), stdout=log, stderr=log)
    try:
        yield kc, log_path
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run_all(kc, code: str, timeout: float = 120) -> list[dict]:
    """Execute ``code``; return every IOPub message seen until the kernel is idle again (any parent)."""
    msg_id = kc.execute(textwrap.dedent(code))
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        seen.append(msg)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            break
    time.sleep(0.5)  # anything a worker sent late would arrive now
    while True:
        try:
            seen.append(kc.get_iopub_msg(timeout=0.2))
        except queue.Empty:
            return seen


def streams(messages: list[dict], name: str) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream" and m["content"]["name"] == name)


def from_pids(messages: list[dict], pids: list[int]) -> list[dict]:
    """Messages whose header says a worker made them (jupyter_client's ids end in ``_<pid>_<n>``)."""
    return [m for m in messages if any(f"_{pid}_" in m["header"]["msg_id"] for pid in pids)]


TQDM_CELL = """
    import os
    {preimport}
    from nbaccel import notebook_launcher

    def train():
        {import_in_worker}
        for _ in tqdm(range(5), desc="epoch"):
            pass
        return os.getpid(), None

    shown = notebook_launcher(train, num_processes=2, return_all=True)
    print("pids", [pid for pid, _ in shown.values()])
"""


PRE = "from tqdm.auto import tqdm  # in the kernel: tqdm.notebook's widget bar"


@pytest.mark.parametrize(("preimport", "import_in_worker"), [
    ("", "from tqdm.auto import tqdm"),
    (PRE, "from tqdm.auto import tqdm"),
    (PRE, "pass  # the notebook's own tqdm, bound before the fork"),
], ids=["imported-in-worker", "kernel-imported-first", "kernel-bound-name"])
def test_tqdm_auto_in_two_workers_prints_text_bars_and_sends_nothing_on_the_kernels_channels(
        kernel, preimport, import_in_worker):
    kc, log_path = kernel
    run_all(kc, "import nbaccel")
    log_before = log_path.read_text()
    messages = run_all(kc, TQDM_CELL.replace("{preimport}", preimport).replace("{import_in_worker}", import_in_worker))
    out, err = streams(messages, "stdout"), streams(messages, "stderr")
    line = next(line for line in out.splitlines() if line.startswith("pids"))
    pids = [int(p) for p in line.split("[")[1].split("]")[0].split(",")]
    assert len(pids) == 2 and os.getpid() not in pids
    assert "widgets made in a worker" not in err  # no widget bar was even built

    assert "[rank0]: epoch: 100%" in out and "[rank1]: epoch: 100%" in out  # bars end as progress, on stdout
    assert "epoch: 100%" not in err
    assert from_pids(messages, pids) == []
    assert not [m for m in messages if m["msg_type"].startswith("comm")]
    assert log_path.read_text() == log_before  # the kernel's own stderr (the server's log) got nothing


def test_a_widget_built_in_a_worker_is_noted_once_and_never_sent(kernel):
    kc, log_path = kernel
    run_all(kc, "import nbaccel, ipywidgets")
    log_before = log_path.read_text()
    messages = run_all(kc, """
        import os
        from nbaccel import notebook_launcher
        from IPython.display import display

        def panel():
            import ipywidgets
            from IPython import get_ipython
            sliders = [ipywidgets.IntSlider(value=i) for i in range(3)]
            display(sliders[0])
            print("shell", type(get_ipython()).__name__)
            return os.getpid()

        print("pid", notebook_launcher(panel, num_processes=1))
    """)
    err = streams(messages, "stderr")
    assert err.count("widgets made in a worker are not shown") == 1, err
    assert "[rank0]: shell WorkerShell" in streams(messages, "stdout")
    assert not [m for m in messages if m["msg_type"].startswith("comm") or m["msg_type"] == "display_data"]
    assert log_path.read_text() == log_before


def test_the_kernels_own_shell_held_by_a_notebook_name_cannot_send_from_a_worker(kernel):
    kc, log_path = kernel
    run_all(kc, "import nbaccel")
    log_before = log_path.read_text()
    messages = run_all(kc, """
        import os
        from nbaccel import notebook_launcher
        kernel_shell = get_ipython()   # the kernel's ZMQInteractiveShell, reachable from the worker's globals

        def use_it():
            from ipykernel.ipkernel import IPythonKernel
            from ipykernel.kernelapp import IPKernelApp
            kernel_shell.display_pub.publish({"text/plain": "through the kernel's socket"})
            kernel_shell.display_pub.publish({"text/plain": "again"})
            print("singletons", IPythonKernel.initialized(), IPKernelApp.initialized())
            return os.getpid()

        print("pid", notebook_launcher(use_it, num_processes=1))
    """)
    assert "[rank0]: singletons False False" in streams(messages, "stdout")
    pid = int(streams(messages, "stdout").split("pid ")[1].split()[0])
    err = streams(messages, "stderr")
    assert err.count("through the Jupyter kernel's own channel, which only the kernel may use") == 1, err
    assert "'display_data'" in err
    assert from_pids(messages, [pid]) == []
    assert not [m for m in messages if m["msg_type"] == "display_data"]
    assert log_path.read_text() == log_before
