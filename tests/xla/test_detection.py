"""TPU detection, the runtime-initialized check and the replica count, all without initializing XLA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

from nbaccel.errors import (
    ConfigError,
    EnvironmentStateError,
    LaunchError,
    MissingDependencyError,
)
from nbaccel.hardware import tpu_detected, xla_runtime_initialized
from nbaccel.launch.xla.topology import (
    check_xla_launch,
    probe_replica_count,
    xla_replica_count,
)

pytestmark = pytest.mark.xla

REPO = Path(__file__).resolve().parents[2]


def fake_machine(root: Path, chips: int = 0, device_id: str = "0x0063", accel_files: int = 0) -> str:
    """A filesystem root with ``chips`` TPU chips on its PCI bus (plus an unrelated NIC) and /dev files."""
    nic = root / "sys/bus/pci/devices/0000:00:03.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x8086\n")
    (nic / "device").write_text("0x0063\n")
    for i in range(chips):
        chip = root / f"sys/bus/pci/devices/0000:00:{4 + i:02x}.0"
        chip.mkdir(parents=True)
        (chip / "vendor").write_text("0x1ae0\n")
        (chip / "device").write_text(device_id + "\n")
    (root / "dev").mkdir(exist_ok=True)
    for i in range(accel_files):
        (root / f"dev/accel{i}").write_text("")
    return str(root)


def test_override_decides_both_ways(tmp_path):
    tpu_vm = fake_machine(tmp_path, chips=4)
    assert tpu_detected({"NBACCEL_TPU": "0", "PJRT_DEVICE": "TPU"}, root=tpu_vm) is False
    assert tpu_detected({"NBACCEL_TPU": "1", "PJRT_DEVICE": "CPU"}, root=str(tmp_path / "nothing")) is True


def test_override_with_a_bad_value_names_it():
    with pytest.raises(ConfigError) as info:
        tpu_detected({"NBACCEL_TPU": "maybe"})
    assert info.value.key == "NBACCEL_TPU" and info.value.value == "maybe"


def test_pjrt_device_is_an_explicit_choice(tmp_path):
    tpu_vm = fake_machine(tmp_path, chips=4)
    assert tpu_detected({"PJRT_DEVICE": "TPU"}, root=str(tmp_path / "nothing")) is True
    assert tpu_detected({"PJRT_DEVICE": "CPU"}, root=tpu_vm) is False  # CPU runtime chosen on a TPU VM


@pytest.mark.parametrize("name,value", [("TPU_ACCELERATOR_TYPE", "v2-8"), ("COLAB_TPU_ADDR", "10.0.0.2:8470"),
                                        ("TPU_NAME", "local"), ("TPU_WORKER_ID", "0")])
def test_tpu_environment_variables(tmp_path, name, value):
    empty = fake_machine(tmp_path)
    assert tpu_detected({name: value}, root=empty) is True


def test_pci_chips_and_device_files(tmp_path):
    assert tpu_detected({}, root=fake_machine(tmp_path / "a", chips=1)) is True
    assert tpu_detected({}, root=fake_machine(tmp_path / "b", accel_files=4)) is True
    assert tpu_detected({}, root=fake_machine(tmp_path / "c")) is False  # a Google-less PCI bus, no /dev/accel


def test_this_machine_has_no_tpu():
    assert tpu_detected({}) is False


def test_runtime_initialized_is_read_without_initializing_and_then_refuses_launches():
    import torch_xla  # noqa: F401 - imported, not initialized

    assert xla_runtime_initialized() is False
    code = ("import torch, torch_xla\nfrom nbaccel.hardware import xla_runtime_initialized as f\n"
            "from nbaccel.errors import EnvironmentStateError\n"
            "from nbaccel.launch.xla.topology import check_xla_launch\n"
            "before = f(); torch.ones(1, device='xla').cpu(); print(before, f())\n"
            "try:\n    check_xla_launch(None, None)\nexcept EnvironmentStateError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, refusal = out.stdout.splitlines()[-2:]
    assert first == "False True", out.stderr[-2000:]
    assert refusal.startswith("refused: the XLA runtime is already initialized") and "restart the kernel" in refusal


def test_replica_count_on_the_cpu_runtime(tmp_path):
    assert xla_replica_count({"PJRT_DEVICE": "CPU"}) == 1
    assert xla_replica_count({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}) == 4
    assert xla_replica_count({}, root=fake_machine(tmp_path)) == 1  # no TPU: torch_xla falls back to CPU
    with pytest.raises(ConfigError) as info:
        xla_replica_count({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "zero"})
    assert info.value.key == "CPU_NUM_DEVICES"


@pytest.mark.parametrize("device_id,chips,bounds,expected", [
    ("0x0027", 4, None, 8),     # v2-8 / v3-8 (Colab, Kaggle): 4 chips, 2 cores each
    ("0x0063", 4, None, 4),     # v5e-4: one device per chip
    ("0x006f", 8, None, 8),     # v6e-8
    ("0x0063", 4, "1,1,1", 1),  # TPU_PROCESS_BOUNDS limits the processes to one chip
])
@pytest.mark.parametrize("pjrt_device", ["TPU", None])  # unset on a TPU VM: torch_xla picks the TPU
def test_replica_count_on_a_tpu_from_the_pci_bus(tmp_path, device_id, chips, bounds, expected, pjrt_device,
                                                  monkeypatch):
    monkeypatch.setattr("nbaccel.launch.xla.topology.probe_replica_count", _no_probe)
    env = ({"PJRT_DEVICE": pjrt_device} if pjrt_device else {}) | ({"TPU_PROCESS_BOUNDS": bounds} if bounds else {})
    assert xla_replica_count(env, root=fake_machine(tmp_path, chips=chips, device_id=device_id)) == expected


def _no_probe(timeout: float = 0) -> int:
    raise AssertionError("the count was readable from the PCI bus, but a child runtime was asked")


def test_probe_asks_a_child_runtime(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    assert probe_replica_count() == 3
    assert xla_runtime_initialized() is False


def test_probe_failure_and_timeout_are_launch_errors(monkeypatch):
    with pytest.raises(LaunchError, match="took over"):
        probe_replica_count(timeout=0.01)
    monkeypatch.setenv("PJRT_DEVICE", "NO_SUCH_DEVICE")
    with pytest.raises(LaunchError, match="could not ask the XLA runtime"):
        xla_replica_count()  # an unknown device type goes to the probe, which fails


def test_check_refuses_spawn(devices):
    devices(2)
    with pytest.raises(ConfigError) as info:
        check_xla_launch(None, "spawn")
    assert info.value.key == "start_method"
    assert check_xla_launch(None, "fork") == (2, None) and check_xla_launch(1, None) == (1, None)


def test_the_cpu_runtime_runs_any_count(devices):
    devices(2)
    assert check_xla_launch(3, None) == (3, None)


@pytest.mark.parametrize("device_id,chips,asked,ran", [
    ("0x0063", 1, 8, 1),  # a notebook written for a v3-8 on a v5e-1
    ("0x005e", 4, 8, 4),  # ... on a v4-8
    ("0x0027", 4, 4, 8),  # 4 (chips) on a v3-8: its 8 cores
    ("0x0063", 4, 2, 4),  # fewer than all: torch_xla cannot, every device runs
])
def test_num_processes_on_a_tpu_runs_every_device_and_says_so(tmp_path, device_id, chips, asked, ran):
    root = fake_machine(tmp_path, chips=chips, device_id=device_id)
    count, note = check_xla_launch(asked, None, {"PJRT_DEVICE": "TPU"}, root=root)
    assert count == ran
    assert f"num_processes={asked}" in note and f"running {ran}" in note
    assert check_xla_launch(1, None, {"PJRT_DEVICE": "TPU"}, root=root) == (1, None)
    assert check_xla_launch(ran, None, {"PJRT_DEVICE": "TPU"}, root=root) == (ran, None)


@pytest.mark.parametrize("env", [{"TPU_NAME": "local"}, {"COLAB_TPU_ADDR": "10.0.0.2:8470"},
                                 {"PJRT_DEVICE": "TPU"}, {"PJRT_DEVICE": "TPU", "TPU_ACCELERATOR_TYPE": "v5e-1"}])
def test_a_tpu_known_only_from_the_environment_is_refused(tmp_path, env):
    no_chips = fake_machine(tmp_path)
    with pytest.raises(EnvironmentStateError, match="no TPU chip is visible") as info:
        check_xla_launch(None, None, env, root=no_chips)
    assert f"{next(iter(env))}=" in str(info.value) and "PJRT_DEVICE=CPU" in str(info.value)
    with_chips = fake_machine(tmp_path / "vm", chips=1)
    assert check_xla_launch(None, None, env, root=with_chips) == (1, None)
    assert check_xla_launch(None, None, env | {"PJRT_DEVICE": "CPU"}, root=no_chips) == (1, None)


def test_missing_torch_xla_is_named(tmp_path):
    main_python = REPO / ".venv/bin/python"  # the main environment has no torch_xla
    if not main_python.exists():
        pytest.skip("the main environment (.venv) is not here")
    code = ("from nbaccel.launch.xla.topology import check_xla_launch\n"
            "from nbaccel.errors import MissingDependencyError\n"
            "try:\n    check_xla_launch(None, None)\nexcept MissingDependencyError as e:\n"
            "    print(e.package, '|', e.install)\n")
    out = subprocess.run([str(main_python), "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    if "No module named" in out.stderr:
        pytest.skip("the main environment cannot import nbaccel")
    assert out.stdout.strip() == "torch_xla | pip install torch_xla", out.stderr[-2000:]
    assert MissingDependencyError and EnvironmentStateError  # the types the checks raise
