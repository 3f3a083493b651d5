"""Fault matrix, round three, the checkpoint rows: readers and writers of one folder at the same time.

Real processes share one checkpoint folder: one saves in a loop while another loads in a loop, or
two save in a loop. Every save writes one number (its generation) into the model's weights, the
optimizer's momentum and a registered counter, so a load that mixed two saves shows it. Every
load must be one whole save and none may raise; concurrent saves must all succeed, one after the
other, and leave one whole checkpoint and no temporary sibling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
import json, sys, time
import torch
import nbaccel

class Counter:
    def __init__(self): self.count = 0
    def state_dict(self): return {"count": self.count}
    def load_state_dict(self, state): self.count = state["count"]

accelerator = nbaccel.Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(1, 256)).sum().backward()
optimizer.step()  # momentum buffers exist from here on
counter = Counter()
accelerator.register_for_checkpointing(counter)
prepared, _ = accelerator.prepare(model, optimizer)
folder, seconds = sys.argv[1], float(sys.argv[2])

def generations():
    weights = {p.flatten()[0].item() for p in model.parameters()} | {p.min().item() for p in model.parameters()}
    momentum = {optimizer.state[p]["momentum_buffer"].max().item() for p in model.parameters()}
    return weights | momentum | {float(counter.count)}
"""

SAVER = SETUP + """
def become(generation):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(generation)
            optimizer.state[p]["momentum_buffer"].fill_(generation)
    counter.count = generation

start = int(sys.argv[3])
errors, saves = [], 0
if start == 0:
    become(0)
    accelerator.save_state(folder)
print("ready", flush=True)
sys.stdin.readline()  # every process starts its loop together, however long its imports took
end = time.monotonic() + seconds
while time.monotonic() < end:
    saves += 1
    become(start + saves)
    try:
        accelerator.save_state(folder)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
print(json.dumps({"saves": saves, "errors": errors}), flush=True)
"""

LOADER = SETUP + """
errors, mixed, loads, seen = [], [], 0, set()
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
while loads == 0 or time.monotonic() < end:
    loads += 1
    try:
        accelerator.load_state(folder)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        continue
    found = generations()
    seen |= found
    if len(found) != 1:
        mixed.append(sorted(found))
print(json.dumps({"loads": loads, "errors": errors, "mixed": mixed, "generations": len(seen)}), flush=True)
"""


def _start(script: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _together(*processes: subprocess.Popen) -> None:
    """Wait until every process is set up (and the first save exists), then start their loops at once."""
    for process in processes:
        line = process.stdout.readline().strip()
        assert line == "ready", process.communicate(timeout=60)[1][-3000:]
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()


def _report(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_a_load_beside_a_saving_process_is_always_one_whole_save(tmp_path):
    folder = tmp_path / "ckpt"
    saver, loader = _start(SAVER, folder, 5, 0), _start(LOADER, folder, 5)
    try:
        _together(saver, loader)  # the saver is ready once its first save exists
        loaded = _report(loader)
    finally:
        saved = _report(saver)
    assert saved["errors"] == [] and saved["saves"] > 1
    assert loaded["errors"] == [], loaded["errors"][:3]
    assert loaded["mixed"] == [], f"{len(loaded['mixed'])} of {loaded['loads']} loads mixed two saves"
    assert loaded["loads"] > 1 and loaded["generations"] > 1  # it saw the saves go by
    assert _siblings(folder) == []


def test_two_processes_saving_into_one_folder_take_turns(tmp_path):
    folder = tmp_path / "ckpt"
    first, second = _start(SAVER, folder, 4, 0), _start(SAVER, folder, 4, 1_000_000)
    try:
        _together(first, second)
    finally:
        reports = [_report(first), _report(second)]
    for report in reports:
        assert report["errors"] == [], report["errors"][:3]
        assert report["saves"] > 1
    check = _start(LOADER, folder, 0)
    _together(check)
    loaded = _report(check)
    assert loaded["errors"] == [] and loaded["mixed"] == [] and loaded["loads"] == 1
    assert _siblings(folder) == []
