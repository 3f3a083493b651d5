"""Accelerate's availability probes: is an optional package installed, is a device or dtype usable here.

A package counts as installed when it can be found *and* has package metadata (a stray folder of
the same name does not count), as in Accelerate; nothing is imported to find out. Version checks
(:func:`compare_versions`, :func:`is_torch_version`) use ``packaging``'s ordering.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import operator
import os
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version, parse

from nbaccel.errors import ConfigError

__all__ = [
    "compare_versions", "is_bf16_available", "is_cuda_available", "is_datasets_available", "is_deepspeed_available",
    "is_fp16_available", "is_import_timer_available", "is_lomo_available", "is_matplotlib_available",
    "is_mps_available", "is_pandas_available", "is_peft_available", "is_peft_model", "is_pynvml_available",
    "is_pytest_available", "is_rich_available", "is_schedulefree_available", "is_timm_available",
    "is_torch_version", "is_torch_xla_available", "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available", "is_torchvision_available", "is_transformers_available",
    "is_triton_available", "is_mlflow_available", "is_tensorboard_available", "is_trackio_available",
    "is_wandb_available",
]

OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {">": operator.gt, ">=": operator.ge, "==": operator.eq,
                                                     "!=": operator.ne, "<=": operator.le, "<": operator.lt}


def _installed(name: str, metadata_name: str | None = None) -> bool:
    try:
        if importlib.util.find_spec(name) is None:
            return False
        importlib.metadata.metadata(metadata_name or name)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return False
    return True


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (given by name) or a version with ``requirement_version``.

    Raises:
        ConfigError: ``operation`` is not one of ``>``, ``>=``, ``==``, ``!=``, ``<=``, ``<``.

    Example:
        >>> compare_versions("torch", ">=", "2.0")
        True
    """
    if operation not in OPERATIONS:
        raise ConfigError(f"`operation` must be one of {list(OPERATIONS)} (got {operation!r}). Fix: e.g. '>='.",
                          key="operation", value=operation, valid=tuple(OPERATIONS))
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return OPERATIONS[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version with ``version`` (e.g. ``is_torch_version(">=", "2.4")``)."""
    return compare_versions(parse(torch.__version__), operation, version)


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is usable, found without initializing CUDA (so fork stays safe)."""
    from nbaccel.hardware import cuda_device_count

    return cuda_device_count() > 0


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is usable (torch at least ``min_version``)."""
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether ``torch_xla`` is installed (and, when asked, runs on TPU or on GPU).

    Raises:
        ConfigError: both ``check_is_tpu`` and ``check_is_gpu``.
    """
    if check_is_tpu and check_is_gpu:
        raise ConfigError("pass at most one of check_is_tpu and check_is_gpu. Fix: ask about one device kind.",
                          key="check_is_tpu", value=True, valid=("check_is_tpu", "check_is_gpu"))
    if not _installed("torch_xla"):
        return False
    if check_is_tpu or check_is_gpu:
        import torch_xla.runtime as xr

        kind = xr.device_type()
        return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")
    return True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 works here: on a TPU (unless ``ignore_tpu``), a GPU that supports it, or the CPU.

    On a CUDA machine this asks the GPU, which initializes CUDA (as Accelerate's does).
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available() -> bool:
    """Whether fp16 works here (everywhere nbaccel runs; Gaudi 1, which lacks it, is not supported)."""
    return True


def is_rich_available() -> bool:
    """Whether ``rich`` is installed and enabled with ``ACCELERATE_ENABLE_RICH=1``, as in Accelerate."""
    from nbaccel.environment import env_flag

    return _installed("rich") and env_flag(os.environ, "ACCELERATE_ENABLE_RICH")


def is_pynvml_available() -> bool:
    """Whether NVML's Python bindings are installed (``pynvml`` or ``nvidia-ml-py``)."""
    return _installed("pynvml") or _installed("pynvml", "nvidia-ml-py")


def is_triton_available() -> bool:
    """Whether Triton is installed."""
    return _installed("triton")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata 0.8 or newer (with ``StatefulDataLoader``) is installed."""
    return _installed("torchdata") and compare_versions("torchdata", ">=", "0.8.0")


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (``False`` when peft is not installed)."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _package_probe(package: str, name: str) -> Callable[[], bool]:
    def probe() -> bool:
        return _installed(package)

    probe.__name__ = probe.__qualname__ = name
    probe.__doc__ = f"Whether ``{package}`` is installed."
    return probe


is_datasets_available = _package_probe("datasets", "is_datasets_available")
is_deepspeed_available = _package_probe("deepspeed", "is_deepspeed_available")
is_import_timer_available = _package_probe("import_timer", "is_import_timer_available")
is_lomo_available = _package_probe("lomo_optim", "is_lomo_available")
is_matplotlib_available = _package_probe("matplotlib", "is_matplotlib_available")
is_pandas_available = _package_probe("pandas", "is_pandas_available")
is_peft_available = _package_probe("peft", "is_peft_available")
is_pytest_available = _package_probe("pytest", "is_pytest_available")
is_schedulefree_available = _package_probe("schedulefree", "is_schedulefree_available")
is_timm_available = _package_probe("timm", "is_timm_available")
is_torchdata_available = _package_probe("torchdata", "is_torchdata_available")
is_torchvision_available = _package_probe("torchvision", "is_torchvision_available")
is_transformers_available = _package_probe("transformers", "is_transformers_available")


def is_tensorboard_available() -> bool:
    """Whether ``tensorboard`` (or ``tensorboardX``) is installed: nbaccel's TensorBoard tracker can run."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_mlflow_available() -> bool:
    """Whether ``mlflow`` (or ``mlflow-skinny``, the same client) is installed."""
    return _installed("mlflow") or _installed("mlflow", "mlflow-skinny")


is_trackio_available = _package_probe("trackio", "is_trackio_available")
is_wandb_available = _package_probe("wandb", "is_wandb_available")
