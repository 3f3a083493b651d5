"""Collectives through the Accelerator: gather_for_metrics, gather, pad, reduce, broadcast, splits."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nbaccel
from nbaccel.config import LaunchConfig
from tests.training.helpers import CountingStream, launch


def _evaluate(num_samples: int, batch_size: int, as_objects: bool) -> list:
    accelerator = nbaccel.Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(num_samples), batch_size=batch_size))
    seen = []
    for batch in loader:
        if as_objects:
            seen += accelerator.gather_for_metrics([f"s{int(i)}" for i in batch])
        else:
            seen += accelerator.gather_for_metrics(batch).tolist()
    return seen


@pytest.mark.parametrize("num_processes", [2, 3])
def test_gather_for_metrics_returns_each_of_101_samples_once_in_order(num_processes):
    results = launch(_evaluate, num_processes, 101, 4, False)
    for rank in range(num_processes):
        assert results[rank] == list(range(101))


def test_gather_for_metrics_of_objects_drops_the_padding_too():
    results = launch(_evaluate, 2, 101, 4, True)
    assert results[1] == [f"s{i}" for i in range(101)]


def _evaluate_rows_as_objects() -> list:
    accelerator = nbaccel.Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(11), batch_size=4))
    return [int(x) for batch in loader for x in accelerator.gather_for_metrics(batch, use_gather_object=True)]


def test_gather_for_metrics_with_gather_object_drops_the_duplicated_end_samples():
    # 2 processes x 4 = 8 per step: the second step holds samples 8..10 plus 5 repeated ones.
    results = launch(_evaluate_rows_as_objects, 2)
    assert results[0] == results[1] == list(range(11))


def _evaluate_stream() -> list:
    accelerator = nbaccel.Accelerator()
    loader = accelerator.prepare(DataLoader(CountingStream(11), batch_size=2))
    return [x for batch in loader for x in accelerator.gather_for_metrics(batch.reshape(-1)).tolist()]


def test_gather_for_metrics_over_an_iterable_dataset():
    results = launch(_evaluate_stream, 2)
    assert results[0] == list(range(11))


def _collectives() -> dict:
    acc = nbaccel.Accelerator()
    rank = acc.process_index
    out = {}
    out["gather"] = acc.gather({"a": torch.tensor([rank]), "b": [torch.tensor(float(rank))]})
    out["objects"] = acc.gather_object([f"r{rank}"])
    padded = acc.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1)
    out["padded"] = acc.gather(padded)
    out["pad_first"] = acc.pad_across_processes(torch.ones(rank + 1), pad_first=True)
    out["sum"] = acc.reduce(torch.tensor([rank + 1.0]), "sum")
    out["mean"] = acc.reduce(torch.tensor([rank + 1.0]), "mean")
    out["max"] = acc.reduce(torch.tensor([rank + 1.0, 5.0 - rank]), "max")
    out["none"] = acc.reduce(torch.tensor([rank + 1.0]), "none")
    out["scalar_objects"] = acc.gather_object(rank)
    out["tensor_rows"] = acc.gather_object(torch.tensor([rank, rank]))
    out["broadcast"] = acc.broadcast(torch.tensor([rank * 10]), from_process=1)
    out["bcast_objects"] = nbaccel.broadcast_object_list([rank, "x"], from_process=1)
    with acc.split_between_processes(list("abcde")) as part:
        out["split"] = part
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
        out["split_padded"] = part
    with acc.split_between_processes({"x": [1, 2, 3], "y": [4, 5, 6]}) as part:
        out["split_dict"] = part
    with acc.main_process_first():
        pass
    with acc.local_main_process_first():
        pass
    out["only_local_main"] = acc.on_local_main_process(lambda: "local main")()
    out["only_main"] = acc.on_main_process(lambda: "main")()
    out["only_last"] = acc.on_last_process(lambda: "last")()
    out["only_rank1"] = acc.on_process(process_index=1)(lambda: "one")()
    out["only_local0"] = acc.on_local_process(local_process_index=0)(lambda: "local0")()
    if rank == 1:
        acc.set_trigger()
    out["trigger"] = acc.check_trigger()
    out["trigger_again"] = acc.check_trigger()
    acc.wait_for_everyone()
    return out


def test_collectives_on_two_processes():
    results = launch(_collectives, 2)
    r0, r1 = results[0], results[1]
    assert r0["gather"]["a"].tolist() == [0, 1] and r0["gather"]["b"][0].tolist() == [0.0, 1.0]
    assert r0["objects"] == ["r0", "r1"]
    assert r0["padded"].tolist() == [[1, 1], [-1, -1], [1, 1], [1, 1]]
    assert r0["pad_first"].tolist() == [0.0, 1.0]
    assert r0["sum"].tolist() == [3.0] and r1["mean"].tolist() == [1.5]
    assert r1["max"].tolist() == [2.0, 5.0] and r0["none"].tolist() == [3.0]  # "none" sums, as in Accelerate
    assert r0["scalar_objects"] == [0, 1]
    assert [int(t) for t in r1["tensor_rows"]] == [0, 0, 1, 1]
    assert r0["broadcast"].tolist() == [10] and r0["bcast_objects"] == [1, "x"]
    assert (r0["split"], r1["split"]) == (["a", "b", "c"], ["d", "e"])
    assert (r0["split_padded"].tolist(), r1["split_padded"].tolist()) == ([0, 1, 2], [3, 4, 4])
    assert r1["split_dict"] == {"x": [3], "y": [6]}
    assert (r0["only_main"], r1["only_main"]) == ("main", None)
    assert (r0["only_last"], r1["only_last"]) == (None, "last")
    assert (r0["only_rank1"], r1["only_rank1"]) == (None, "one")
    assert r0["only_local0"] == "local0" and r1["only_local0"] is None
    assert (r0["only_local_main"], r1["only_local_main"]) == ("local main", None)
    assert r0["trigger"] and r1["trigger"] and not r0["trigger_again"]


def _mismatched_gather() -> None:
    acc = nbaccel.Accelerator()
    acc.gather(torch.zeros(acc.process_index + 1))


def test_gather_of_mismatched_shapes_is_a_clear_error_in_debug_mode():
    with pytest.raises(nbaccel.DistributedOperationError) as info:
        nbaccel.notebook_launcher(_mismatched_gather, num_processes=2, use_cpu=True, timeout=60,
                                  config=LaunchConfig(debug=True))
    assert info.value.operation == "gather"
    assert info.value.shapes == {0: (1,), 1: (2,)}


def test_single_process_collectives_return_their_input():
    acc = nbaccel.Accelerator()
    t = torch.arange(3)
    assert acc.gather(t) is t
    assert acc.gather_object("x") == "x" and acc.gather_object(["x"]) == ["x"]
    assert acc.pad_across_processes(t) is t
    assert acc.reduce(t, "sum").tolist() == [0, 1, 2]
    assert acc.reduce(t, "max").tolist() == [0, 1, 2] and acc.reduce(t, "none") is not t
    with pytest.warns(UserWarning, match="XLA devices only"):
        assert acc.reduce(torch.ones(1), "sum", scale=2.0).tolist() == [1.0]
    assert acc.broadcast(t) is t
    with acc.split_between_processes([1, 2]) as part:
        assert part == [1, 2]
    assert not acc.check_trigger()


def test_invalid_reduction_and_split_inputs_are_config_errors():
    acc = nbaccel.Accelerator()
    with pytest.raises(nbaccel.ConfigError) as info:
        acc.reduce(torch.ones(1), "min")
    assert info.value.value == "min" and info.value.valid == ("sum", "mean", "max", "none")
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\) passed to `_reduce"):
        acc.reduce("not a tensor")
    with pytest.raises(nbaccel.ConfigError):
        acc.on_process(lambda: 1)
    with pytest.raises(nbaccel.ConfigError):
        acc.on_local_process(lambda: 1)
    with pytest.raises(TypeError):
        nbaccel.concatenate(["a", "b"])


def _bad_split() -> None:
    acc = nbaccel.Accelerator()
    with acc.split_between_processes({"x": [1, 2], "y": [1]}):
        pass


def test_split_of_a_dict_with_uneven_values_is_a_config_error():
    with pytest.raises(nbaccel.ConfigError):
        launch(_bad_split, 2)


def _main_first(folder: str) -> str:
    import os
    import time

    acc = nbaccel.Accelerator()
    marker = os.path.join(folder, "built")
    with acc.main_process_first():
        if acc.is_main_process:
            time.sleep(0.3)
            open(marker, "w").close()
        seen = os.path.exists(marker)  # the other rank enters only after the main one left
    acc.print("printed once")
    return seen


def test_main_process_first_runs_the_main_process_before_the_others(tmp_path, capfd):
    assert launch(_main_first, 2, str(tmp_path)) == {0: True, 1: True}
    assert capfd.readouterr().out.count("printed once") == 1


class _Encoding(dict):
    """A model input like transformers' ``BatchEncoding``: a mapping that moves itself with ``.to``."""

    def __init__(self, *args, moved_whole: bool = False) -> None:
        super().__init__(*args)
        self.moved_whole = moved_whole

    def to(self, device, non_blocking=False):
        return _Encoding({k: v.to(device) for k, v in self.items()}, moved_whole=True)


def test_one_send_to_device_for_loaders_optimizers_and_big_model_hooks():
    from collections import namedtuple

    import nbaccel.big_modeling.hooks
    import nbaccel.training.data_loader
    import nbaccel.training.optimizer

    assert nbaccel.big_modeling.hooks.send_to_device is nbaccel.send_to_device
    assert nbaccel.training.optimizer.send_to_device is nbaccel.send_to_device
    Pair = namedtuple("Pair", "a b")
    data = {"x": [torch.ones(1), (Pair(torch.zeros(1), 3),)], "mask": torch.ones(1),
            "enc": _Encoding({"ids": torch.ones(2)})}
    moved = nbaccel.send_to_device(data, "meta", skip_keys="mask")
    assert moved["x"][0].is_meta and moved["x"][1][0].a.is_meta and moved["x"][1][0].b == 3
    assert not moved["mask"].is_meta and moved["enc"].moved_whole and moved["enc"]["ids"].is_meta
    assert nbaccel.send_to_device(torch.nn.Linear, "meta") is torch.nn.Linear  # a class is not data
