"""Fault matrix, round two, config rows: a hostile config file is refused fast, in one short line.

A 476-byte "billion laughs" YAML, deep nesting in YAML and JSON, a file too large, and a FIFO or a
directory named like a config file: each is a ``ConfigError`` naming the file, with no traceback
from ``nbaccel env``, and nothing of the file is built.
"""

from __future__ import annotations

import os
import resource

import pytest

from nbaccel.config import load_config
from nbaccel.config_text import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_EXPANDED_NODES
from nbaccel.errors import ConfigError
from tests.cli.helpers import nbaccel as run_nbaccel

BILLION_LAUGHS = "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


def _refusal(path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 1000 and str(path) in message and "Fix:" in message
    assert info.value.key == "config_file" and info.value.value == str(path)
    return info.value


def test_billion_laughs_is_refused_at_once_in_one_line(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 500
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = _refusal(path)
    assert f"{MAX_EXPANDED_NODES:,}" in str(error) and "aliases" in str(error)
    # nothing was expanded: the peak memory of this process grew by less than 50 MB (it was 5.4 GB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024


def test_aliases_within_the_budget_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("fsdp_config: &d {fsdp_offload_params: false}\ndeepspeed_config: *d\nnum_processes: 2\n")
    config = load_config(path)
    assert config.num_processes == 2 and config.deepspeed_config == {"fsdp_offload_params": False}


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    (".yaml", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v\n"),
    (".json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".json", '{"a": ' + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "}"),
])
def test_deep_nesting_is_a_config_error_not_a_recursion_error(tmp_path, suffix, text):
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    assert f"nesting deeper than {MAX_DEPTH}" in str(_refusal(path))


def test_a_file_past_the_size_cap_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("num_processes: 2\n# " + "x" * MAX_CONFIG_BYTES + "\n")
    assert f"more bytes than {MAX_CONFIG_BYTES:,}" in str(_refusal(path))


def test_a_huge_value_is_quoted_in_a_bounded_message(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("mixed_precision: " + "x" * 500_000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(str(info.value)) <= 2000 and "characters left out" in str(info.value)
    assert str(info.value).rstrip().endswith("Fix: set mixed_precision to one of those.")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_is_refused_by_name_without_blocking(tmp_path, kind):
    path = tmp_path / "default_config.yaml"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    error = _refusal(path)
    assert f"is not a regular file (it is a {'FIFO (named pipe)' if kind == 'fifo' else 'directory'})" in str(error)


def test_nbaccel_env_reports_the_billion_laughs_in_one_line(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    done = run_nbaccel("env", "--config_file", str(path))
    assert "Traceback" not in done.stdout + done.stderr
    assert f"{MAX_EXPANDED_NODES:,}" in done.stdout + done.stderr
