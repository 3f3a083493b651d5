"""One size parser, with Accelerate's meaning, for max_memory and max_shard_size alike."""

from __future__ import annotations

import json

import pytest
import torch

import nbaccel
from nbaccel.big_modeling.sizes import get_max_memory
from nbaccel.file_size import convert_file_size_to_int

ACCEPTED = ["1MiB", "512mib", "1.5GiB", "2KiB", "5GB", "5gb", "8Mb", "8MB", "100kb", "100KB", "2 MB", "1.5 MB",
            "0GB", 0, 7, 10**12]
REFUSED = ["100", "1TB", "5B", "lots", "12XB", "-5MB", "MB", "nanGB", -1]


@pytest.mark.parametrize("size", ACCEPTED)
def test_sizes_read_as_accelerate_reads_them(size):
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    assert convert_file_size_to_int(size) == accelerate_modeling.convert_file_size_to_int(size)


@pytest.mark.parametrize("size", REFUSED)
def test_sizes_accelerate_refuses_are_config_errors(size):
    with pytest.raises(nbaccel.ConfigError) as info:
        convert_file_size_to_int(size, key="max_shard_size")
    assert info.value.key == "max_shard_size" and info.value.value == size
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    with pytest.raises(ValueError):
        accelerate_modeling.convert_file_size_to_int(size)


def test_bits_and_bytes_and_bare_numbers():
    assert convert_file_size_to_int("8Mb") == 10**6 and convert_file_size_to_int("8MB") == 8 * 10**6
    assert convert_file_size_to_int("1KiB") == 1024 and convert_file_size_to_int(100) == 100
    for bad in (True, 1.5, None):
        with pytest.raises(nbaccel.ConfigError):
            convert_file_size_to_int(bad)  # type: ignore[arg-type]  # the wrong type is the test


def test_max_memory_and_max_shard_size_read_sizes_the_same_way(tmp_path):
    assert get_max_memory({"cpu": "8Mb"})["cpu"] == 10**6
    with pytest.raises(nbaccel.ConfigError) as info:
        get_max_memory({"cpu": "100"})
    assert info.value.key == "max_memory"
    accelerator = nbaccel.Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(400, 400, bias=False), torch.nn.Linear(400, 400, bias=False))
    accelerator.save_model(model, tmp_path / "bits", max_shard_size="8Mb")  # 1 MB: each 640 kB weight alone
    index = json.loads((tmp_path / "bits" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    accelerator.save_model(model, tmp_path / "bytes", max_shard_size="8MB")  # both fit in one file
    assert sorted(p.name for p in (tmp_path / "bytes").iterdir()) == ["model.safetensors"]
    with pytest.raises(nbaccel.ConfigError) as info:
        accelerator.save_model(model, tmp_path / "bare", max_shard_size="100")
    assert info.value.key == "max_shard_size"
