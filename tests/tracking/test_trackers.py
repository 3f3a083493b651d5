"""Each tracker writes what its own library's reader reads back, in 1 and 2 processes (only rank 0 writes)."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import pytest

import nbaccel
from nbaccel.tracking import GeneralTracker, LoggerType, on_main_process
from tests.tracking import readers

LIBRARY = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}


def _need(name: str) -> None:
    if importlib.util.find_spec(LIBRARY[name]) is None:
        pytest.skip(f"{LIBRARY[name]} is not installed (pip install 'nbaccel[{name}]')")


def _train_and_log(log_with, project_dir: str, project: str, steps: int = 3) -> None:
    accelerator = nbaccel.Accelerator(log_with=log_with, project_dir=project_dir)
    accelerator.init_trackers(project, config={"lr": 0.1, "batch_size": 4})
    for step in range(steps):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
    accelerator.end_training()


def _read_back(name: str, folder: Path, project: str) -> list[tuple[int, float]]:
    """``(step, loss)`` of every run ``name`` wrote for ``project``; also checks that exactly one run was written."""
    if name == "tensorboard":
        return readers.tensorboard_scalars(folder / project, "loss")
    if name == "mlflow":
        runs = readers.mlflow_runs(folder / "mlruns", project)
        assert len(runs) == 1 and runs[0]["params"] == {"lr": "0.1", "batch_size": "4"}
        return runs[0]["metrics"]["loss"]
    if name == "wandb":
        runs = readers.wandb_offline_runs(folder)
        assert len(runs) == 1 and runs[0]["config"] == {"lr": 0.1, "batch_size": 4}
        return [(row["_step"], row["loss"]) for row in runs[0]["history"]]
    runs = readers.trackio_logs(project)
    assert len(runs) == 1
    return [(row["step"], row["loss"]) for row in next(iter(runs.values()))]


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_one_process_writes_what_the_trackers_reader_reads_back(name, tmp_path):
    _need(name)
    project = f"p{uuid.uuid4().hex[:8]}"
    _train_and_log(name, str(tmp_path), project)
    got = _read_back(name, tmp_path, project)
    assert [step for step, _ in got] == [0, 1, 2]
    assert [round(value, 4) for _, value in got] == [1.0, 0.5, 0.3333]


def test_an_mlflow_tracker_without_an_experiment_name_logs_to_mlflows_default_experiment(tmp_path, monkeypatch):
    """It used to ask mlflow to create an experiment named None (MlflowException at start)."""
    _need("mlflow")
    from nbaccel.tracking.mlflow_tracker import MLflowTracker

    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    tracker = MLflowTracker(logging_dir=str(tmp_path))
    tracker.start()
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert [run["metrics"]["loss"] for run in readers.mlflow_runs(tmp_path / "mlruns", "Default")] == [[(0, 1.0)]]


def test_tensorboard_text_and_grouped_scalars(tmp_path):
    _need("tensorboard")
    import torch

    accelerator = nbaccel.Accelerator(log_with=LoggerType.TENSORBOARD, project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    accelerator.log({"loss": torch.tensor(0.25), "note": "warmup", "acc": {"train": 0.5, "test": 0.4}}, step=7)
    accelerator.end_training()
    assert readers.tensorboard_scalars(tmp_path / "run", "loss") == [(7, 0.25)]
    assert readers.tensorboard_scalars(tmp_path / "run" / "acc_train", "acc") == [(7, 0.5)]
    assert accelerator.get_tracker("tensorboard").name == "tensorboard"
    assert type(accelerator.get_tracker("tensorboard", unwrap=True)).__name__ == "SummaryWriter"


class RankFiles(GeneralTracker):
    """A custom tracker: writes one JSON-lines file per rank, so a test sees which ranks ran what."""

    name = "rank_files"
    requires_logging_directory = False

    def __init__(self, folder: str, main_process_only: bool = True) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.main_process_only = main_process_only

    @property
    def tracker(self) -> Path:
        return self.folder

    def _write(self, what: str, payload: object) -> None:
        rank = nbaccel.PartialState().process_index
        with open(self.folder / f"{self.name}-{'main' if self.main_process_only else 'all'}-rank{rank}.jsonl",
                  "a") as file:
            file.write(json.dumps([what, payload]) + "\n")

    @on_main_process
    def start(self) -> None:
        self._write("start", None)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self._write("config", values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: object) -> None:
        self._write("log", [step, values, kwargs])

    @on_main_process
    def finish(self) -> None:
        self._write("finish", None)


def _two_process_run(folder: str, project: str, names: list[str]) -> dict:
    accelerator = nbaccel.Accelerator(log_with=[*names, RankFiles(folder), RankFiles(folder, main_process_only=False)],
                                      project_dir=folder)
    accelerator.init_trackers(project, config={"lr": 0.1, "batch_size": 4},
                              init_kwargs={"tensorboard": {"flush_secs": 1}})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step, log_kwargs={"rank_files": {"tag": "t"}})
    unwrapped = {name: accelerator.get_tracker(name, unwrap=True) is not None for name in names}
    accelerator.end_training()
    return {"rank": accelerator.process_index, "unwrapped": unwrapped,
            "trackers": [t.name for t in accelerator.trackers]}


@pytest.mark.slow
def test_two_processes_only_the_main_process_writes(tmp_path):
    names = [n for n in sorted(LIBRARY) if importlib.util.find_spec(LIBRARY[n]) is not None]
    project = f"p{uuid.uuid4().hex[:8]}"
    results = nbaccel.notebook_launcher(_two_process_run, (str(tmp_path), project, names), num_processes=2,
                                        use_cpu=True, return_all=True)
    assert results[0]["unwrapped"] == dict.fromkeys(names, True)  # the library's run exists on rank 0 only
    assert results[1]["unwrapped"] == dict.fromkeys(names, False)
    assert results[0]["trackers"] == results[1]["trackers"]  # built on every rank, as in Accelerate
    for name in names:
        assert [(s, round(v, 4)) for s, v in _read_back(name, tmp_path, project)] == [(0, 1.0), (1, 0.5), (2, 0.3333)]
    if "tensorboard" in names:  # one writer: rank 1 left no event file
        assert len(list((tmp_path / project).glob("events.out.tfevents.*"))) == 1
    main = [json.loads(line) for line in (tmp_path / "rank_files-main-rank0.jsonl").read_text().splitlines()]
    assert [what for what, _ in main] == ["start", "config", "log", "log", "log", "finish"]
    assert main[2][1] == [0, {"loss": 1.0}, {"tag": "t"}]
    assert not (tmp_path / "rank_files-main-rank1.jsonl").exists()
    # main_process_only=False: its methods run wherever they are called; Accelerator.log still runs on rank 0 only
    everywhere = (tmp_path / "rank_files-all-rank1.jsonl").read_text().splitlines()
    assert [json.loads(line)[0] for line in everywhere] == ["start", "config", "finish"]


def test_all_picks_the_installed_trackers(tmp_path):
    accelerator = nbaccel.Accelerator(log_with="all", project_dir=str(tmp_path), notebook_tracker=False)
    installed = [LoggerType(n) for n in ("tensorboard", "mlflow", "wandb", "trackio")
                 if importlib.util.find_spec(LIBRARY[n]) is not None]
    assert sorted(accelerator.log_with) == sorted(installed)
