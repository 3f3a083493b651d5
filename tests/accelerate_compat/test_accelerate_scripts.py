"""Accelerate's own multi-process test scripts, from the installed package, under ``nbaccel launch`` on 2 CPU processes.

Each script runs twice: as it is (Accelerate's ``Accelerator`` inside nbaccel's workers must make one
2-process ``MULTI_CPU`` job, as under ``accelerate launch --cpu``), and with its ``accelerate`` imports
pointed at ``nbaccel`` (nbaccel's ``Accelerator`` must pass Accelerate's checks). Only
``accelerate.test_utils`` (its regression model and data) stays Accelerate's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.helpers import nbaccel

accelerate = pytest.importorskip("accelerate")
SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
# accelerate import lines -> nbaccel's; accelerate.test_utils is left alone
_NAMES = [(r"^from accelerate(\.accelerator|\.state|\.utils\.dataclasses)? import", "from nbaccel import"),
          (r"^from accelerate\.(utils|data_loader) import", r"from nbaccel.\1 import")]


def with_nbaccel_names(script: Path, tmp_path: Path) -> Path:
    text = script.read_text()
    for pattern, replacement in _NAMES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    assert "from nbaccel import Accelerator" in text
    copy = tmp_path / f"nbaccel_{script.name}"
    copy.write_text(text)
    return copy


def launched(script: Path) -> tuple[str, str]:
    done = nbaccel("launch", "--num_processes", "2", str(script), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, done.stderr


@pytest.mark.parametrize("names", ["accelerate", "nbaccel"])
def test_accelerates_test_metrics_passes_as_one_two_process_job(names, tmp_path):
    pytest.importorskip("evaluate")  # the script imports it (its GLUE case needs a GPU and is skipped)
    pytest.importorskip("transformers")
    script = SCRIPTS / "external_deps" / "test_metrics.py"
    out, _ = launched(script if names == "accelerate" else with_nbaccel_names(script, tmp_path))
    # it prints on the local main process only: once, from rank 0, when the two ranks are one job
    assert out.count("**Test torch metrics**") == 1 and "[rank0]: **Test torch metrics**" in out
    assert out.count("**Test that `drop_last` is taken into account**") == 1


def test_accelerates_test_distributed_data_loop_passes_with_nbaccels_accelerator(tmp_path):
    """Under Accelerate's own ``Accelerator`` this script hangs on CPU (its ``join_uneven_inputs`` joins only on
    GPUs, so DDP waits for the rank that ran out); nbaccel joins over gloo too. Its last two cases need
    torchdata's ``StatefulDataLoader``, which nbaccel does not take (README, "Coming from Accelerate"): they go.
    """
    script = with_nbaccel_names(SCRIPTS / "test_distributed_data_loop.py", tmp_path)
    text = script.read_text()
    for stateful in ("    test_stateful_dataloader(accelerator)\n",
                     "    test_stateful_dataloader_save_state(accelerator)\n"):
        assert stateful in text
        text = text.replace(stateful, "")
    script.write_text(text)
    out, _ = launched(script)
    assert out.count("Test join with non DDP distributed raises warning") == 1
    assert "[rank0]: Test DataLoader with sampler as an instance of `BatchSampler`" in out
