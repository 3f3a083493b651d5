"""The example configs in ``examples/configs``: each loads (in nbaccel and in Accelerate), and runs where it can
here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nbaccel
from nbaccel.training.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin

CONFIGS = Path(__file__).parents[1] / "examples" / "configs"
EXPECTED = {  # file -> (distributed_type, processes on this machine, mixed_precision, needs)
    "one_gpu.yaml": ("NO", 1, "no", 1),
    "multi_gpu_ddp.yaml": ("MULTI_GPU", 2, "no", 2),
    "fp16_gpu.yaml": ("MULTI_GPU", 2, "fp16", 2),
    "bf16_gpu.yaml": ("MULTI_GPU", 2, "bf16", 2),
    "fsdp2.yaml": ("FSDP", 2, "bf16", 2),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 2, "bf16", 2),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 2, "bf16", 2),
    "multi_node.yaml": ("MULTI_GPU", 8, "bf16", None),
    "tpu.yaml": ("XLA", 8, "bf16", None),
    "cpu_multi_process.yaml": ("MULTI_CPU", 2, "no", 0),
    "bf16_cpu.yaml": ("MULTI_CPU", 2, "bf16", 0),
}


def test_the_zoo_is_what_the_readme_lists():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)
    readme = (CONFIGS.parents[1] / "README.md").read_text()
    assert all(f"examples/configs/{name}" in readme for name in EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_config_loads_with_its_plugins(name):
    config = nbaccel.load_config(CONFIGS / name)
    kind, processes, precision, _ = EXPECTED[name]
    assert (config.distributed_type, config.num_processes, config.mixed_precision) == (kind, processes, precision)
    assert (CONFIGS / name).read_text().startswith("# ")  # says what it is for
    if config.fsdp_config:
        plugin = FullyShardedDataParallelPlugin.from_config(config.fsdp_config)
        assert plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and plugin.transformer_cls_names_to_wrap == ["Block"]
    if config.deepspeed_config:
        stage = DeepSpeedPlugin.from_config(config.deepspeed_config).deepspeed_config["zero_optimization"]["stage"]
        assert stage == int(name[-6])
    if name == "multi_node.yaml":
        assert (config.num_machines, config.machine_rank, config.main_process_port) == (2, 0, 29500)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_config_is_one_accelerate_reads_too(name):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    theirs = config_args.load_config_from_file(str(CONFIGS / name))
    ours = nbaccel.load_config(CONFIGS / name)
    assert str(theirs.distributed_type).split(".")[-1] == ours.distributed_type.value
    assert str(theirs.mixed_precision) == ours.mixed_precision


def trained() -> dict:
    accelerator = nbaccel.Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"n": accelerator.num_processes, "precision": accelerator.mixed_precision,
            "type": str(accelerator.distributed_type), "device": accelerator.device.type, "losses": losses}


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if e[3] is not None))
def test_each_config_that_fits_this_machine_launches(name):
    kind, processes, precision, gpus = EXPECTED[name]
    if gpus > torch.cuda.device_count():
        pytest.skip(f"{name} needs {gpus} GPU(s)")
    if kind == "DEEPSPEED":
        pytest.importorskip("deepspeed")
    results = nbaccel.notebook_launcher(trained, config=nbaccel.load_config(CONFIGS / name), return_all=True,
                                        timeout=180)
    assert sorted(results) == list(range(processes))
    first = results[0]
    assert (first["n"], first["precision"], first["type"]) == (processes, precision, kind)
    assert first["device"] == ("cpu" if gpus == 0 else "cuda")
    assert first["losses"][-1] < first["losses"][0]
    assert all(r["losses"] == first["losses"] for r in results.values())  # the ranks trained as one
