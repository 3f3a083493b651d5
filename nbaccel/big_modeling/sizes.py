"""Sizes: of modules, of devices (``max_memory``), balanced budgets, and tied parameters.

Memory budgets are ``{device: bytes}`` with GPU indices first, then ``"mps"``, ``"cpu"`` and
``"disk"``. Sizes may be given as strings (``"512MiB"``, ``"10GB"``, ``"1.5GiB"``), read by
:func:`~nbaccel.file_size.convert_file_size_to_int`. Counting
GPUs never initializes CUDA (it goes through NVML), so a budget given by the caller can be
checked in a process that will fork later.
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nbaccel.big_modeling.tensors import as_torch_dtype
from nbaccel.errors import ConfigError
from nbaccel.file_size import convert_file_size_to_int

__all__ = [
    "CustomDtype",
    "MaxMemory",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "planning_budget",
    "tensor_size",
]

MaxMemory = Mapping[int | str, int | str]

_NAMED_DEVICES = ("mps", "cpu", "disk")


class CustomDtype(enum.Enum):
    """Storage formats torch has no dtype for, sized by :func:`dtype_byte_size` (quantized weights).

    Example:
        >>> dtype_byte_size(CustomDtype.INT4)
        0.5
    """

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


_CUSTOM_BYTES = {CustomDtype.FP8: 1, CustomDtype.INT4: 1 / 2, CustomDtype.INT2: 1 / 4}


def dtype_byte_size(dtype: torch.dtype | CustomDtype) -> float:
    """Bytes per element of ``dtype`` (``torch.bool`` counts 1/8, as in Accelerate).

    Example:
        >>> dtype_byte_size(torch.float16)
        2
    """
    if isinstance(dtype, CustomDtype):
        return _CUSTOM_BYTES[dtype]
    if dtype == torch.bool:
        return 1 / 8
    return torch.empty((), dtype=dtype).element_size()


def tensor_size(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``tensor`` once loaded, floating-point tensors counted as ``dtype`` if given.

    Example:
        >>> tensor_size(torch.ones(4), torch.float16), tensor_size(torch.ones(4, dtype=torch.int8))
        (8, 4)
    """
    if dtype is not None and tensor.is_floating_point():
        return int(tensor.numel() * dtype_byte_size(dtype))
    return int(tensor.numel() * dtype_byte_size(tensor.dtype))


def compute_module_sizes(model: nn.Module, dtype: torch.dtype | str | None = None,
                         special_dtypes: Mapping[str, torch.dtype] | None = None,
                         buffers_only: bool = False) -> dict[str, int]:
    """Bytes of every module (and tensor), by name; ``""`` is the whole model.

    A tied parameter counts once, under the first name it has. With ``dtype``, a floating-point
    tensor counts as the smaller of its own dtype and ``dtype``; integer and bool tensors keep
    theirs; a ``special_dtypes`` entry applies to any tensor (as Accelerate sizes them).

    Args:
        model: the model (its tensors may be on the meta device).
        dtype: count floating-point tensors as this dtype (the dtype they will be loaded in).
        special_dtypes: ``{tensor name: dtype}`` exceptions to ``dtype``.
        buffers_only: count only buffers.

    Returns:
        ``{name: bytes}`` for ``""``, every module prefix and every tensor.

    Example:
        >>> compute_module_sizes(torch.nn.Linear(2, 2))[""]
        24
    """
    as_dtype = as_torch_dtype(dtype)
    special = {k: getattr(torch, v.removeprefix("torch.")) if isinstance(v, str) else v
               for k, v in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = list(model.named_buffers()) if buffers_only else \
        [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        size = _load_size(tensor, special.get(name), as_dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return sizes


def _load_size(tensor: torch.Tensor, special: torch.dtype | None,
               dtype: torch.dtype | None) -> int:
    """Bytes once loaded, as Accelerate counts them: a special dtype always applies; ``dtype``
    never widens a tensor and leaves integer and bool tensors alone (loading does not cast them)."""
    if special is not None:
        return int(tensor.numel() * dtype_byte_size(special))
    own = dtype_byte_size(tensor.dtype)
    if dtype is None or not (tensor.is_floating_point() or tensor.is_complex()):
        return int(tensor.numel() * own)
    return int(tensor.numel() * min(own, dtype_byte_size(dtype)))


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. an LM head tied to its embedding).

    Returns:
        Sorted groups, each sorted; untied parameters are not listed.

    Example:
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m.b.weight = m.a.weight
        >>> find_tied_parameters(m)
        [['a.weight', 'b.weight']]
    """
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id[id(param)].append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


def _gpu_count() -> int:
    from nbaccel.hardware import cuda_device_count

    return cuda_device_count()


def _free_gpu_memory(index: int) -> int:
    """Free bytes on GPU ``index``; measuring them initializes CUDA, so only done when asked."""
    return torch.cuda.mem_get_info(index)[0]


def _available_cpu_memory() -> int:
    from nbaccel.hardware import available_cpu_memory

    return available_cpu_memory()


def _device_key(key: object, gpus: int, planning: bool = False) -> int | str:
    valid = f"GPU indices 0..{gpus - 1} or " if gpus else ""
    valid += "'cpu', 'disk', 'mps'"
    if isinstance(key, str) and re.fullmatch(r"cuda:\d+", key):
        key = int(key.split(":")[1])
    if isinstance(key, int) and not isinstance(key, bool):
        if 0 <= key < gpus or (planning and key >= 0):
            return key
        raise ConfigError(
            f"max_memory names GPU {key}, but this machine has {gpus} visible GPU(s). Valid "
            f"keys: {valid}. Drop the key, or check CUDA_VISIBLE_DEVICES.",
            key="max_memory", value=key, valid=valid)
    if key in _NAMED_DEVICES:
        return key
    raise ConfigError(
        f"max_memory has the key {key!r} ({type(key).__name__}), which is not a device. Valid "
        f"keys: {valid}. For example: max_memory={{'cpu': '512MiB'}}.",
        key="max_memory", value=key, valid=valid)


def _sorted_budget(budget: dict[int | str, int]) -> dict[int | str, int]:
    gpus = sorted(k for k in budget if isinstance(k, int))
    order: list[int | str] = [*gpus, *(n for n in _NAMED_DEVICES if n in budget)]
    return {k: budget[k] for k in order}


def get_max_memory(max_memory: MaxMemory | None = None) -> dict[int | str, int]:
    """The memory budget per device, in bytes, in device order (GPUs, ``"mps"``, CPU, disk).

    With ``max_memory`` given, it is checked and converted to bytes, and CUDA is not
    initialized. Without it, each GPU's free memory and the available RAM are measured.

    Args:
        max_memory: ``{device: size}``; sizes as ints or strings such as ``"512MiB"``.

    Returns:
        ``{device: bytes}``.

    Raises:
        ConfigError: ``max_memory`` is not a mapping, names an unknown device or a GPU this
            machine does not have, or holds an unreadable size.

    Example:
        >>> get_max_memory({"cpu": "1GiB"})
        {'cpu': 1073741824}
    """
    gpus = _gpu_count()
    if max_memory is None:
        budget: dict[int | str, int] = {}
        for i in range(gpus):
            budget[i] = _free_gpu_memory(i)
        budget["cpu"] = _available_cpu_memory()
        return budget
    if not isinstance(max_memory, Mapping):
        raise ConfigError(
            f"max_memory must be a dict of device -> size (got {max_memory!r} of type "
            f"{type(max_memory).__name__}). For example: max_memory={{0: '10GiB', 'cpu': "
            "'30GiB'}.", key="max_memory", value=max_memory, valid="dict[int | str, int | str]")
    budget = {}
    for key, size in max_memory.items():
        budget[_device_key(key, gpus)] = convert_file_size_to_int(size, key="max_memory")
    return _sorted_budget(budget)


def planning_budget(max_memory: MaxMemory | None = None) -> dict[int | str, int]:
    """The budget a device map is planned against: :func:`get_max_memory`, except that GPUs need not be here.

    Planning is arithmetic, so ``max_memory={0: "10GiB", "cpu": "30GiB"}`` on a machine without
    GPUs plans the map for the machine the model will run on (as Accelerate does); placing the
    model there (``dispatch_model``) still needs the GPUs.

    Example:
        >>> planning_budget({0: "1KiB", "cpu": 10})
        {0: 1024, 'cpu': 10}
    """
    if max_memory is None or not isinstance(max_memory, Mapping):
        return get_max_memory(max_memory)
    return _sorted_budget({_device_key(key, _gpu_count(), planning=True):
                           convert_file_size_to_int(size, key="max_memory")
                           for key, size in max_memory.items()})


def get_max_layer_size(modules: Sequence[tuple[str, nn.Module | torch.Tensor]],
                       module_sizes: Mapping[str, int],
                       no_split_module_classes: Sequence[str]) -> tuple[int, list[str]]:
    """The largest unsplittable piece among ``modules``: a leaf, or a no-split block.

    Args:
        modules: ``(name, module or tensor)`` pairs to search, recursing into children.
        module_sizes: from :func:`compute_module_sizes`.
        no_split_module_classes: class names never split across devices.

    Returns:
        ``(bytes, names of the pieces of that size)``.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 4))
        >>> get_max_layer_size(list(m.named_children()), compute_module_sizes(m), [])
        (48, ['1'])
    """
    best, names = 0, []
    todo = list(modules)
    while todo:
        name, module = todo.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            prefix = f"{name}." if name else ""
            todo = [(prefix + n, c) for n, c in children] + todo
    return best, names


def get_balanced_memory(model: nn.Module, max_memory: MaxMemory | None = None,
                        no_split_module_classes: Sequence[str] | None = None,
                        dtype: torch.dtype | str | None = None,
                        special_dtypes: Mapping[str, torch.dtype] | None = None,
                        low_zero: bool = False) -> dict[int | str, int]:
    """A budget that spreads the model evenly over the GPUs (for ``device_map="balanced"``).

    Each GPU but the last gets an equal share of the model plus headroom of 1.25 times the
    larger of a no-split block and the mean leaf module, so that whole blocks still fit; the
    last GPU keeps its full budget, to catch what rounding leaves over. CPU and disk are never
    balanced. With one GPU and ``max_memory=None``, 10% of its free memory is kept back for
    activations. The numbers are those Accelerate computes.

    Args:
        model: the model to place.
        max_memory: the upper bounds, as for :func:`get_max_memory`; measured when ``None``.
        no_split_module_classes: class names never split across devices.
        dtype: the dtype weights will be loaded in.
        special_dtypes: ``{tensor name: dtype}`` exceptions to ``dtype``.
        low_zero: keep GPU 0 as empty as possible (``"balanced_low_0"``), for generation.

    Returns:
        ``{device: bytes}``.

    Example:
        >>> get_balanced_memory(torch.nn.Linear(2, 2), {"cpu": 1000})
        {'cpu': 1000}
    """
    budget = planning_budget(max_memory)
    gpus = [k for k in budget if isinstance(k, int) and budget[k] > 0]
    if len(gpus) == 1 and max_memory is None:  # measured, so nothing is left for activations
        budget[gpus[0]] = int(budget[gpus[0]] * 0.9)
    if len(gpus) <= 1:
        return budget
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    share = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    no_split = [no_split_module_classes] if isinstance(no_split_module_classes, str) else \
        list(no_split_module_classes or ())
    share += _balance_headroom(model, sizes, no_split)
    for i in gpus[:-1]:
        if not (low_zero and i == gpus[0]):
            budget[i] = min(budget[i], share)
    if low_zero:
        rest = sum(budget[i] for i in gpus[1:])
        budget[gpus[0]] = min(budget[gpus[0]], max(0, sizes[""] - rest))
    return budget


def _balance_headroom(model: nn.Module, sizes: Mapping[str, int],
                      no_split: Sequence[str]) -> int:
    """1.25 times the larger of the biggest no-split block and the mean leaf module's size.

    A no-split class is sized by its first instance that holds tensors (blocks of one class are
    alike), and a leaf module is one with no submodule holding tensors, as Accelerate sizes them.
    """
    classes = {n: type(m).__name__ for n, m in model.named_modules() if n}
    blocks: dict[str, int] = {}
    for name in sizes:  # tensor order, so the first instance of each class comes first
        if classes.get(name) in no_split:
            blocks.setdefault(classes[name], sizes[name])
    modules = [n for n in sizes if n in classes]
    parents = {n.rpartition(".")[0] for n in modules}
    leaves = [n for n in modules if n not in parents]
    mean_leaf = int(sum(sizes[n] for n in leaves) / max(len(leaves), 1))
    return int(1.25 * max(max(blocks.values(), default=0), mean_leaf))
