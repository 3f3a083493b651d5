"""Mixed precision: the autocast context, the GradScaler, and the fp32-output forward wrapper.

``"bf16"`` runs the forward under ``torch.autocast`` with bfloat16 (CPU, CUDA, XLA) and needs no
scaler. ``"fp16"`` autocasts to float16 and scales the loss with ``torch.amp.GradScaler`` (CUDA,
CPU); XLA devices have no scaler, so fp16 is refused there, as in Accelerate. A prepared model's outputs
are converted back to float32, as in Accelerate, so losses computed outside are full precision.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from typing import Any, get_args

import torch

from nbaccel.environment import MixedPrecision
from nbaccel.errors import ConfigError
from nbaccel.nested_data import recursively_apply
from nbaccel.training.kwargs_handlers import AutocastKwargs, GradScalerKwargs

__all__ = ["PrecisionType", "autocast_context", "convert_outputs_to_fp32", "get_grad_scaler",
           "get_mixed_precision_context_manager", "make_grad_scaler", "validate_mixed_precision"]

# fp8: torchao's Float8Linear layers do the fp8 matmuls; the rest runs under bf16 autocast, as in Accelerate.
_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
_VALID: tuple[MixedPrecision, ...] = get_args(MixedPrecision)



class PrecisionType(str, enum.Enum):
    """Accelerate's ``PrecisionType``: the values ``mixed_precision`` takes, as a ``str`` enum."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"

def validate_mixed_precision(value: object) -> MixedPrecision:
    """Check a ``mixed_precision`` value (whether fp8 can run here is :mod:`nbaccel.training.fp8`'s check).

    Raises:
        ConfigError: the value is not one of ``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``.
    """
    if value not in _VALID:
        raise ConfigError(f"`mixed_precision` must be one of {list(_VALID)} (got {value!r}). Fix: pass "
                          "mixed_precision='bf16' (or 'no')", key="mixed_precision", value=value, valid=_VALID)
    return value


def autocast_context(mixed_precision: MixedPrecision, device: torch.device,
                     handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
    """The ``torch.autocast`` context for ``mixed_precision`` on ``device`` (a null context for ``"no"``).

    Example:
        >>> with autocast_context("bf16", torch.device("cpu")):
        ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> y.dtype
        torch.bfloat16
    """
    handler = handler or AutocastKwargs()
    if mixed_precision == "no" or not handler.enabled:
        return contextlib.nullcontext()
    kwargs: dict[str, Any] = {"dtype": _DTYPES[mixed_precision]}
    if handler.cache_enabled is not None:
        kwargs["cache_enabled"] = handler.cache_enabled
    return torch.autocast(device_type=device.type, **kwargs)


def make_grad_scaler(mixed_precision: MixedPrecision, device: torch.device,
                     handler: GradScalerKwargs | None = None) -> torch.amp.GradScaler | None:
    """A ``GradScaler`` for fp16; ``None`` for the other precisions.

    Raises:
        ConfigError: fp16 on an XLA device (no scaler exists there; bf16 needs none).

    Example:
        >>> make_grad_scaler("fp16", torch.device("cpu")) is not None
        True
    """
    if mixed_precision != "fp16":
        return None
    if device.type == "xla":
        valid = tuple(p for p in _VALID if p not in ("fp16", "fp8"))
        raise ConfigError(f"mixed_precision='fp16' is not supported on XLA devices (got device {device}): they have "
                          f"no GradScaler, so fp16 gradients would underflow unnoticed; valid there: {list(valid)}. "
                          "Fix: pass mixed_precision='bf16'", key="mixed_precision", value=mixed_precision,
                          valid=valid)
    kwargs = (handler or GradScalerKwargs()).to_kwargs()
    return torch.amp.GradScaler(device.type, **kwargs)


def get_grad_scaler(distributed_type: str | None = None, **kwargs: Any) -> Any:
    """Accelerate's ``get_grad_scaler``: a ``GradScaler`` for this machine's accelerator (sharded for FSDP).

    Args:
        distributed_type: ``"FSDP"`` gives torch's ``ShardedGradScaler``.
        **kwargs: the scaler's arguments (``init_scale``, ``growth_interval``, ...).

    Example:
        >>> get_grad_scaler(init_scale=8.0).get_scale()
        8.0
    """
    if distributed_type == "FSDP":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    from nbaccel.hardware import cuda_device_count

    return torch.amp.GradScaler("cuda" if cuda_device_count() else "cpu", **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
                                        ) -> contextlib.AbstractContextManager[Any]:
    """Accelerate's ``get_mixed_precision_context_manager``: autocast for this process's mixed precision.

    With ``native_amp=False`` a null context. The precision is the launch's (this process's
    state), as in Accelerate.

    Example:
        >>> with get_mixed_precision_context_manager():   # no autocast
        ...     pass
    """
    if not native_amp:
        return contextlib.nullcontext()
    from nbaccel.process_state import ProcessState

    state = ProcessState()
    return autocast_context(state.mixed_precision, state.device, autocast_kwargs)


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``model_forward`` so half-precision tensors in its output come back as float32."""
    @functools.wraps(model_forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return recursively_apply(_to_fp32, model_forward(*args, **kwargs))

    return wrapped


def wrap_forward(model: torch.nn.Module, mixed_precision: MixedPrecision, device: torch.device,
                 handler: AutocastKwargs | None = None) -> None:
    """Run ``model``'s forward under autocast with fp32 outputs; undone by :func:`unwrap_forward`."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast_context(mixed_precision, device, handler):
            out = original(*args, **kwargs)
        return recursively_apply(_to_fp32, out)

    forward._nbaccel_original = original  # type: ignore[attr-defined]  # marks the wrapper for unwrapping
    model.forward = forward


def unwrap_forward(model: torch.nn.Module) -> None:
    """Remove the :func:`wrap_forward` wrapper from ``model`` (if any)."""
    forward = model.__dict__.get("forward")
    if forward is not None and hasattr(forward, "_nbaccel_original"):
        original = forward._nbaccel_original
        if getattr(original, "__self__", None) is model and original.__func__ is type(model).forward:
            del model.__dict__["forward"]
        else:
            model.forward = original
