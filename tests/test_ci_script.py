"""scripts/test.sh, what CI runs, exits with its suites' status: 0 when they all pass, a failing suite's otherwise.

The real suites take half an hour, so the script runs here in a stand-in tree: its own text and
scripts/tests_beside_main.sh's, with setup, pip and each suite replaced by a line of shell that says
where it ran and exits with the status a test picks. What is under test is the scripts' control flow:
the Ray, floor and XLA suites run beside the main suite in a network namespace and temporary folder
of their own, and every status reaches the exit status. (An EXIT trap whose ``kill`` of the finished
background job failed once turned a green run's exit status into 1 under ``set -e``: CI refused a run
whose every suite had passed.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.launch.procs import alive
from tests.pool.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root, as the Ray suite")


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def stand_in_tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    for real in ("test.sh", "tests_beside_main.sh", "loopback_namespace.py"):
        shutil.copy(ROOT / "scripts" / real, tmp_path / "scripts" / real)
    _script(tmp_path / "scripts" / "setup.sh", "exit 0")
    # Each suite says where it ran (its network namespace and temporary folder), then exits as the test asks.
    where = 'echo "$1 in $(readlink /proc/self/ns/net) tmp=${TMPDIR:-/tmp}"'
    _script(tmp_path / "scripts" / "test_ray.sh", f'set -- ray; {where}; exit "${{RC_RAY:-0}}"')
    _script(tmp_path / ".venv" / "bin" / "pip", "exit 0")
    # The main suite is `python -m pytest`; the namespace helper is python too, and runs for real.
    _script(tmp_path / ".venv" / "bin" / "python",
            f'if [ "$1" = -m ]; then set -- main; {where}; exit "${{RC_MAIN:-0}}"; fi\nexec python3 "$@"')
    for suite, name in (("run_torch_floor.sh", "floor"), ("run_xla.sh", "xla")):
        # The background build (NBACCEL_PREPARE_ONLY=1) takes a moment, so the main suite runs beside it.
        _script(tmp_path / "tests" / suite,
                f'if [ "${{NBACCEL_PREPARE_ONLY:-0}}" = 1 ]; then\n'
                f'  sleep 0.3; echo "built {name}"; exit "${{RC_BUILD:-0}}"\nfi\n'
                f'set -- {name}; {where}; exit "${{RC_{name.upper()}:-0}}"')
    return tmp_path


def _run_test_sh(tree: Path, **statuses: int) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NBACCEL_SKIP_")}
    env.update({key: str(value) for key, value in statuses.items()})
    return subprocess.run(["bash", "scripts/test.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def test_a_run_whose_suites_all_pass_exits_0(stand_in_tree: Path):
    done = _run_test_sh(stand_in_tree)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("suite", ["RC_MAIN", "RC_RAY", "RC_FLOOR", "RC_XLA", "RC_BUILD"])
def test_a_failing_suite_fails_the_run_with_its_status(stand_in_tree: Path, suite: str):
    done = _run_test_sh(stand_in_tree, **{suite: 3})
    assert done.returncode == 3, done.stderr


def test_the_suites_beside_the_main_one_run_in_a_namespace_and_temporary_folder_of_their_own(stand_in_tree: Path):
    done = _run_test_sh(stand_in_tree)
    where = dict(line.split(" in ", 1) for line in done.stdout.splitlines() if " in net:" in line)
    assert set(where) == {"main", "ray", "floor", "xla"}, done.stdout
    main_net, main_tmp = where.pop("main").split()
    for suite, (net, tmp) in ((suite, place.split()) for suite, place in where.items()):
        assert net != main_net, f"{suite} ran in the main suite's network namespace"
        assert tmp != main_tmp and tmp.startswith("tmp=/tmp/nbaccel-beside."), f"{suite}: {tmp}"
        assert not Path(tmp.removeprefix("tmp=")).exists(), "the suites' temporary folder is left behind"
    order = [line.split(" in ")[0] for line in done.stdout.splitlines() if " in net:" in line]
    assert order[0] == "main"  # the others' output comes after the main suite's


def test_a_failed_background_build_is_shown_and_fails_the_run(stand_in_tree: Path):
    _script(stand_in_tree / "tests" / "run_xla.sh",
            'if [ "${NBACCEL_PREPARE_ONLY:-0}" = 1 ]; then echo "pip: no space left"; exit 1; fi\nexit 0')
    done = _run_test_sh(stand_in_tree)
    assert done.returncode == 1, done.stderr
    assert "===== build-xla (run beside the main suite): exit status 1" in done.stdout
    assert "pip: no space left" in done.stdout


def test_skipped_suites_are_not_run(stand_in_tree: Path):
    done = _run_test_sh(stand_in_tree, NBACCEL_SKIP_RAY=1, NBACCEL_SKIP_XLA=1, RC_RAY=3, RC_XLA=3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray in" not in done.stdout and "xla in" not in done.stdout and "floor in" in done.stdout


def test_a_failed_setup_fails_the_run_and_stops_the_builds_it_started_beside(stand_in_tree: Path):
    pid_file = stand_in_tree / "build.pid"
    _script(stand_in_tree / "tests" / "run_torch_floor.sh", f'echo $$ > {pid_file}; exec sleep 60')
    _script(stand_in_tree / "scripts" / "setup.sh", f'while [ ! -s {pid_file} ]; do sleep 0.05; done; exit 7')
    done = _run_test_sh(stand_in_tree)
    assert done.returncode == 7, done.stdout + done.stderr
    build = int(pid_file.read_text())
    assert wait_for(lambda: not alive(build), 5), "the background build outlived test.sh"
