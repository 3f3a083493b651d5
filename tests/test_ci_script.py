"""scripts/test.sh, what CI runs, exits with its suites' status: 0 when they all pass, a failing suite's otherwise.

The real suites take half an hour, so the script runs here in a stand-in tree: its own text, with
setup, pip and each suite replaced by a line of shell that exits with the status a test picks. What is
under test is test.sh's own control flow: the background venv build, its EXIT trap and the status it
collects. (An EXIT trap whose ``kill`` of the finished background job failed once turned a green run's
exit status into 1 under ``set -e``: CI refused a run whose every suite had passed.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def stand_in_tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    _script(tmp_path / "scripts" / "setup.sh", "exit 0")
    _script(tmp_path / "scripts" / "test_ray.sh", 'exit "${RC_RAY:-0}"')
    _script(tmp_path / ".venv" / "bin" / "pip", "exit 0")
    _script(tmp_path / ".venv" / "bin" / "python", 'exit "${RC_MAIN:-0}"')
    for suite, variable in (("run_torch_floor.sh", "RC_FLOOR"), ("run_xla.sh", "RC_XLA")):
        # The background build (NBACCEL_PREPARE_ONLY=1) takes a moment, so the main suite runs beside it.
        _script(tmp_path / "tests" / suite,
                f'if [ "${{NBACCEL_PREPARE_ONLY:-0}}" = 1 ]; then sleep 0.3; exit 0; fi\nexit "${{{variable}:-0}}"')
    return tmp_path


def _run_test_sh(tree: Path, **statuses: int) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NBACCEL_SKIP_")}
    env.update({key: str(value) for key, value in statuses.items()})
    return subprocess.run(["bash", "scripts/test.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def test_a_run_whose_suites_all_pass_exits_0(stand_in_tree: Path):
    done = _run_test_sh(stand_in_tree)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("suite", ["RC_MAIN", "RC_RAY", "RC_FLOOR", "RC_XLA"])
def test_a_failing_suite_fails_the_run_with_its_status(stand_in_tree: Path, suite: str):
    done = _run_test_sh(stand_in_tree, **{suite: 3})
    assert done.returncode == 3, done.stderr


def test_a_failed_background_build_is_shown_and_the_suites_still_run(stand_in_tree: Path):
    _script(stand_in_tree / "tests" / "run_xla.sh",
            'if [ "${NBACCEL_PREPARE_ONLY:-0}" = 1 ]; then echo "pip: no space left"; exit 1; fi\nexit 0')
    done = _run_test_sh(stand_in_tree)
    assert done.returncode == 0, done.stderr
    assert "building the floor/XLA venvs in the background failed" in done.stderr
    assert "pip: no space left" in done.stderr
