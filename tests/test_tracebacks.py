"""One traceback trimmer for the notebook and the terminal: the launcher's frames go, the rest stays."""

from __future__ import annotations

from nbaccel.tracebacks import clean_traceback

WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/usr/lib/python3.11/runpy.py", line 88, in _run_code
    exec(code, run_globals)
  File "/site/nbaccel/launch/worker/process.py", line 120, in run_worker
    result = function(*args)
             ^^^^^^^^^^^^^^^
  File "/site/nbaccel/magics/cell.py", line 200, in run_cell_program
    exec(code, namespace)
  File "/tmp/ipykernel_1/3141.py", line 4, in train
    accelerator.prepare(model, device_placement=[True, False])
  File "/site/nbaccel/training/accelerator.py", line 250, in prepare
    raise ConfigError(msg)
nbaccel.errors.ConfigError: `device_placement` needs one entry per object
"""


def test_the_launchers_frames_are_dropped_and_the_libraries_kept():
    text = clean_traceback(WORKER_TRACEBACK)
    assert "runpy" not in text and "nbaccel/launch" not in text and "nbaccel/magics" not in text
    assert "result = function(*args)" not in text and "^^^" not in text  # a dropped frame's source lines go too
    assert 'File "/tmp/ipykernel_1/3141.py", line 4, in train' in text  # the user's code
    assert 'File "/site/nbaccel/training/accelerator.py", line 250, in prepare\n    raise ConfigError(msg)' in text
    assert text.endswith("ConfigError: `device_placement` needs one entry per object")


def test_notebook_cells_are_named_as_ipython_names_them():
    text = clean_traceback(WORKER_TRACEBACK, {"/tmp/ipykernel_1/3141.py": 7})
    assert "  Cell In[7], line 4, in train\n    accelerator.prepare(" in text
    assert text.splitlines()[0] == "Traceback (most recent call last):"


def test_the_terminal_and_the_notebook_share_the_trimmer():
    import nbaccel.cli.launch_cmd
    import nbaccel.magics.render

    assert nbaccel.cli.launch_cmd.clean_traceback is nbaccel.magics.render.clean_traceback is clean_traceback
