"""``benchmarks/big_model_gpu.py`` on a CPU machine: the parts that need no GPU (budgets both
libraries accept, the Llama checkpoint it writes, the report lines), so a GPU session runs it as is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.big_modeling.sizes import planning_budget

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("big_model_gpu", BENCH / "big_model_gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("case", ["auto_cpu", "auto_disk"])
def test_every_budget_parses_in_nbaccel_and_in_accelerate(bench, case) -> None:
    """The disk case passed "1431655765B", which both reject: it died before any figure."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    budget = bench.case_budget(case, 32, 8192)
    assert planning_budget(budget)["cpu"] > 0
    assert accelerate_utils.convert_file_size_to_int(budget["cpu"]) > 0
    import big_model_gpu_llama as llama

    assert planning_budget(llama.budget(6 * 2**30)) == {0: 6 * 2**30 // 4, "cpu": 25 * 2**30}


def test_the_llama_checkpoint_loads_and_runs_offloaded(bench, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import big_model_gpu_llama as llama

    config = llama.llama_config(layers=2, hidden=64, intermediate=128, vocab=128)
    folder, total = llama.write_llama(tmp_path, config)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == llama.SHARDS and index["metadata"]["total_size"] == total
    run = llama.worker("nbaccel", str(folder), str(tmp_path), device="cpu", prompt=5)
    assert run["tokens"] == llama.NEW_TOKENS and run["offloaded"] > total // 2  # disk, on a CPU machine
    (written,) = tmp_path.glob("llama-tokens-nbaccel-*.json")
    assert len(json.loads(written.read_text())) == llama.NEW_TOKENS


def test_without_a_gpu_it_says_so_in_one_line() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "big_model_gpu.py"), "--cases", "llama"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "GPU cases skipped: no CUDA device on this machine (they need one GPU)."]
