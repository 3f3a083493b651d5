"""Read back what each tracker wrote, with that tracker's own reader (one copy for the tracking tests)."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from pathlib import Path
from typing import Any


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` in every event file directly in ``folder`` (TensorBoard's EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: list[tuple[int, float]] = []
    for path in sorted(glob.glob(str(folder / "events.out.tfevents.*"))):
        acc = EventAccumulator(path)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            found += [(e.step, e.value) for e in acc.Scalars(tag)]
    return found


def mlflow_runs(store: Path, experiment: str) -> list[dict[str, Any]]:
    """Each run of ``experiment`` in the file store ``store``: params and each metric's ``(step, value)``."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = []
    for run in client.search_runs([exp.experiment_id]):
        metrics = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
                   for k in run.data.metrics}
        runs.append({"params": dict(run.data.params), "metrics": metrics})
    return runs


_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # crc32, length, chunk type (LevelDB's log format)


def _wandb_records(path: str) -> list[bytes]:
    """The records of a ``.wandb`` file: W&B's 7-byte file header, then LevelDB log blocks."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, offset = [], b"", 7
    while offset + _HEADER.size <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER.size:  # the block's tail is padding
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        chunk, offset = data[offset:offset + length], offset + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    return records


def _finished_records(path: str, wait: float = 20.0) -> list[Any]:
    """The parsed records, once wandb's service has written the run's ``exit`` record (it writes after
    ``run.finish()`` returns)."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + wait
    while True:
        records = []
        for raw in _wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_offline_runs(folder: Path) -> list[dict[str, Any]]:
    """Every offline run under ``folder/wandb``: its history rows and config, parsed with wandb's protobufs."""
    runs = []
    for path in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))):
        history, config = [], {}
        for record in _finished_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        runs.append({"history": history, "config": config})
    return runs


def trackio_logs(project: str) -> dict[str, list[dict[str, Any]]]:
    """``{run name: its logs}`` of a trackio project (trackio's SQLiteStorage; TRACKIO_DIR as set)."""
    from trackio.sqlite_storage import SQLiteStorage

    return {run: SQLiteStorage.get_logs(project, run) for run in SQLiteStorage.get_runs(project)}
