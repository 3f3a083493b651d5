"""`nbaccel env`: versions, devices and the config in effect, ready to paste into a bug report.

:func:`env_report` builds the text; the ``%accel_env`` magic shows the same report in a
notebook. Nothing here initializes CUDA or the XLA runtime: GPUs are counted through NVML and
named by ``nvidia-smi``, and torch_xla's version is read from its package metadata.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import yaml

from nbaccel.config import LaunchConfig, load_config
from nbaccel.environment import config_file_path
from nbaccel.errors import ConfigError
from nbaccel.hardware import (
    cpu_count,
    cuda_device_count,
    fork_unsafe_reason,
    in_colab,
    in_kaggle,
    in_notebook,
    tpu_detected,
)
from nbaccel.version import __version__

__all__ = ["env_report", "register"]

# Variables set outside nbaccel that change how a launch behaves; shown when present.
_RELEVANT_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PJRT_DEVICE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "SLURM_JOB_ID", "SLURM_NNODES",
    "SLURM_NODEID", "SLURM_PROCID",
)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_lines() -> list[str]:
    import torch

    cuda = torch.version.cuda
    lines = [f"- PyTorch version: {torch.__version__}",
             f"- PyTorch built with CUDA: {cuda or 'no'}"]
    if cuda and hasattr(torch._C, "_nccl_version"):  # compile-time version: no CUDA init
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            nccl = "unknown"
        lines.append(f"- NCCL version: {nccl}")
    hip = getattr(torch.version, "hip", None)
    if hip:
        lines.append(f"- ROCm (HIP) version: {hip}")
    lines.append(f"- torch_xla version: {_version('torch_xla')}")
    lines.append(f"- NumPy version: {_version('numpy')}")
    return lines


def _gpu_names() -> list[str]:
    """GPU names from ``nvidia-smi`` (a separate process, so CUDA stays untouched here)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return "unknown"
    return f"{pages * size / 2**30:.1f} GiB"


def _device_lines() -> list[str]:
    gpus = cuda_device_count()
    lines = ["- Devices:", f"  - CPUs available to this process: {cpu_count()}",
             f"  - System RAM: {_memory_gib()}", f"  - CUDA GPUs visible: {gpus}"]
    lines += [f"    - GPU {i}: {name}" for i, name in enumerate(_gpu_names())]
    lines.append(f"  - TPU detected: {'yes' if tpu_detected() else 'no'}")
    return lines


def _where_lines() -> list[str]:
    if in_colab():
        where = "Google Colab"
    elif in_kaggle():
        where = "Kaggle"
    elif in_notebook():
        where = "Jupyter kernel"
    else:
        where = "terminal / script"
    unsafe = fork_unsafe_reason()
    method = "fork (safe here)" if unsafe is None else f"spawn ({unsafe})"
    lines = [f"- Running in: {where}", f"- Start method a launch would use: {method}"]
    present = [name for name in _RELEVANT_VARIABLES if name in os.environ]
    if present:
        lines.append("- Environment variables:")
        lines += [f"  - {name}={os.environ[name]}" for name in present]
    return lines


def _config_lines(config_file: str | os.PathLike[str] | None) -> list[str]:
    path = Path(config_file) if config_file is not None else config_file_path()
    if not path.exists() and config_file is None:
        cfg, where = LaunchConfig(), (f"- Config file: {path} (not written yet: "
                                      "nbaccel's defaults, `nbaccel config` writes one)")
    else:
        try:
            cfg, where = load_config(path), f"- Config file: {path}"
        except ConfigError as exc:
            return [f"- Config file: {path}", f"- Config in effect: INVALID: {exc}"]
    lines = [where, "- Config in effect:"]
    dumped = yaml.safe_dump(cfg.to_mapping(), sort_keys=True, default_flow_style=False)
    lines += [f"    {line}" for line in dumped.splitlines()]
    if cfg.unused_keys:
        lines.append(f"- Accelerate keys kept but not used by nbaccel: {', '.join(cfg.unused_keys)}")
    return lines


def env_report(config_file: str | os.PathLike[str] | None = None) -> str:
    """The environment report: versions, devices, where we run, and the config in effect.

    Args:
        config_file: the config file to show; default :func:`nbaccel.environment.config_file_path`.

    Returns:
        Markdown-style text, ready to paste into a bug report. An invalid config file is
        reported in the text, never raised.

    Example:
        >>> print(env_report())  # doctest: +SKIP
        Copy-and-paste the text below in your GitHub issue.
        ...
    """
    lines = ["Copy-and-paste the text below in your GitHub issue.", "",
             f"- nbaccel version: {__version__}",
             f"- Python version: {platform.python_version()} ({platform.python_implementation()}, "
             f"{sys.executable})",
             f"- Platform: {platform.platform()}"]
    lines += _torch_lines()
    lines += _device_lines()
    lines += _where_lines()
    lines += _config_lines(config_file)
    return "\n".join(lines) + "\n"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nbaccel env`` to the command line."""
    parser = subparsers.add_parser("env", help="print versions, devices and the config, for a bug report",
                                   description="Print nbaccel's environment report, ready to paste into a bug report.")
    parser.add_argument("--config_file", "--config-file", default=None, metavar="PATH",
                        help="the config file to report (default: $NBACCEL_CONFIG_FILE or the cache directory)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; 0 on success."""
    if args.config_file is not None and not Path(args.config_file).exists():
        raise ConfigError(f"--config_file {args.config_file!r} does not exist. Fix: pass an existing file, "
                          "or write one with `nbaccel config --config_file PATH`.", key="config_file",
                          value=args.config_file, valid="an existing file")
    sys.stdout.write(env_report(args.config_file))
    return 0
