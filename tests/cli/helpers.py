"""Running the real ``nbaccel`` command in a subprocess, and looking for processes it left behind."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

NBACCEL = Path(sys.executable).parent / "nbaccel"  # the installed console script
COMMAND = [str(NBACCEL)] if NBACCEL.exists() else [sys.executable, "-m", "nbaccel.cli.main"]


def env_with(**extra: str) -> dict[str, str]:
    """This process's environment (NBACCEL_CONFIG_FILE already points into tmp_path) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def nbaccel(*args: str, input: str | None = "",  # noqa: A002 - subprocess.run's name for the same argument
            env: dict[str, str] | None = None, timeout: float = 120, cwd: str | os.PathLike[str] | None = None,
            module: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``nbaccel *args`` (or ``python -m nbaccel.cli.main`` when ``module``) and capture its output."""
    command = [sys.executable, "-m", "nbaccel.cli.main"] if module else COMMAND
    return subprocess.run([*command, *args], input=input, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else env_with(), cwd=cwd)


def write_script(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


class Running:
    """``nbaccel *args`` started in its own process group, its stdout read line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env if env is not None else env_with(), start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, *needles: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        missing = set(needles)
        while missing:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"never saw {sorted(missing)}; saw {self.seen}") from None
            self.seen.append(line)
            missing = {n for n in missing if n not in line}

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def processes_in_group(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found
