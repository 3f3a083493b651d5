"""Out-of-memory retries: `find_executable_batch_size` runs a function with smaller batches until it fits."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["find_executable_batch_size", "is_out_of_memory", "release_memory"]

# What PyTorch's allocators say when they run out (CUDA/HIP/XPU, MPS, CPU), and cuDNN's refusal of a size.
_OOM_MESSAGES = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                 "DefaultCPUAllocator: can't allocate memory")


def is_out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch may avoid.

    Example:
        >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")), is_out_of_memory(KeyError())
        (True, False)
    """
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(text in exception.args[0] for text in _OOM_MESSAGES)
    return False


def _free_cached_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Any:
    """Decorate ``function(batch_size, ...)`` to retry with a smaller batch after out-of-memory errors.

    As in Accelerate: the decorated function is called without its first argument, which the
    decorator supplies, starting at ``starting_batch_size`` and multiplied by 0.9 after each
    out-of-memory error (CPU or accelerator, see :func:`is_out_of_memory`); other errors pass through.

    Args:
        function: the function; leave out to use as ``@find_executable_batch_size(starting_batch_size=...)``.
        starting_batch_size: the first batch size tried.
        reduce_batch_size_fn: returns the next batch size to try (default: 0.9 times the last).

    Raises:
        TypeError: the batch size was passed by the caller too.
        RuntimeError: the batch size reached zero without the function fitting in memory.

    Example:
        >>> @find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size):
        ...     if batch_size > 40:
        ...         raise RuntimeError("CUDA out of memory.")
        ...     return batch_size
        >>> train()
        40
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def smaller() -> int:
        return int(batch_size * 0.9)

    next_size = reduce_batch_size_fn or smaller
    params = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        if len(params) < len(args) + 1:
            shown = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"`{function.__name__}` got the batch size from its caller too, but "
                            f"find_executable_batch_size passes it as the first argument; call "
                            f"`{function.__name__}({shown})`")
        _free_cached_memory()
        while True:
            if batch_size <= 0:
                raise RuntimeError(f"find_executable_batch_size: no batch size from {starting_batch_size} down to 1 "
                                   f"fits in memory for `{function.__name__}`; make the model or inputs smaller")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                _free_cached_memory()
                batch_size = next_size()

    return wrapper


def release_memory(*objects: Any) -> list[None]:
    """Drop the caller's references to ``objects`` and free cached device memory, as Accelerate's does.

    Use as ``a, b = release_memory(a, b)``: the returned ``None`` s replace the caller's names.

    Example:
        >>> model = torch.nn.Linear(1, 1); (model,) = release_memory(model); model is None
        True
    """
    from nbaccel.big_modeling.tensors import clear_device_cache

    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released
