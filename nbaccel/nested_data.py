"""Nested batches (lists, tuples, namedtuples, dicts of tensors): walk, move, slice, join and convert them.

:func:`recursively_apply` walks any nesting; :func:`send_to_device` moves it (the one used by
prepared loaders, optimizers and the big-model hooks); ``concatenate``, ``find_batch_size``,
``slice_tensors``, ``listify``, ``convert_to_fp32`` and the rest are Accelerate's helpers over the
same structures. Nothing here talks to other processes: collectives are :mod:`nbaccel.ops`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from nbaccel.errors import ConfigError

__all__ = [
    "TensorInformation",
    "concatenate",
    "convert_to_fp32",
    "find_batch_size",
    "get_data_structure",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "listify",
    "merge_dicts",
    "pad_input_tensors",
    "recursive_getattr",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
]


def recursively_apply(func: Callable[..., Any], data: Any, *args: Any,
                      test_type: Callable[[Any], bool] = torch.is_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the nesting.

    Raises:
        TypeError: a leaf fails ``test_type`` and ``error_on_other_type`` is set.

    Example:
        >>> recursively_apply(lambda t: t * 2, {"a": [torch.ones(1)]})["a"][0].item()
        2.0
    """
    if isinstance(data, (tuple, list)):
        items = [recursively_apply(func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type,
                                   **kwargs) for o in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        return _mapping_like(data, {k: recursively_apply(func, v, *args, test_type=test_type,
                                                         error_on_other_type=error_on_other_type, **kwargs)
                                    for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
                        "list/tuple/dicts of objects that are valid for "
                        f"`{_test_name(test_type)}` should be passed.")  # Accelerate's words, which its tests check
    return data


def _test_name(test_type: Callable[[Any], bool]) -> str:
    # Accelerate's default test is its own is_torch_tensor; nbaccel's is torch.is_tensor, named so in the message
    return "is_torch_tensor" if test_type is torch.is_tensor else getattr(test_type, "__name__", repr(test_type))


def send_to_device(tensor: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: list[str] | str | None = None) -> Any:
    """Move every tensor (or object with ``.to``) in a nested list/tuple/dict to ``device``.

    Accelerate's ``send_to_device``: the one used by prepared dataloaders, optimizers and the
    big-model hooks alike.

    Args:
        tensor: a tensor, an object with ``.to`` (a model input such as ``BatchEncoding``), or
            nested lists, tuples (named too) and mappings of them; anything else is left as is.
        device: where to move them (an int is a CUDA device index).
        non_blocking: copy asynchronously where the device allows.
        skip_keys: mapping keys whose values stay where they are (at every level).

    Returns:
        The same structure, moved.

    Example:
        >>> moved = send_to_device({"x": torch.ones(1), "mask": torch.ones(1)}, "meta", skip_keys="mask")
        >>> moved["x"].device.type, moved["mask"].device.type
        ('meta', 'cpu')
    """
    if hasattr(tensor, "to") and not isinstance(tensor, type):  # first, as Accelerate: a BatchEncoding moves whole
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # objects whose .to takes no non_blocking
            return tensor.to(device)
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    if isinstance(tensor, (tuple, list)):
        items = [send_to_device(o, device, non_blocking, skip_keys) for o in tensor]
        return type(tensor)(*items) if hasattr(tensor, "_fields") else type(tensor)(items)
    if isinstance(tensor, Mapping):
        return _mapping_like(tensor, {k: v if skip_keys and k in skip_keys
                                      else send_to_device(v, device, non_blocking, skip_keys)
                                      for k, v in tensor.items()})
    return tensor


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-structured nests of tensors leaf by leaf (containers keep their type).

    A list of one item that is not a tensor comes back as that item, as in Accelerate.

    Raises:
        TypeError: the items are not tensors or nests of tensors.

    Example:
        >>> concatenate([(torch.ones(1),), (torch.zeros(2),)])
        (tensor([1., 0., 0.]),)
    """
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return _mapping_like(first, {k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if torch.is_tensor(first):
        return torch.cat(data, dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise TypeError(f"concatenate takes tensors or nests of them (got {type(first).__name__}). "
                    "Fix: gather only the tensors, or use gather_object for other objects")


def find_batch_size(data: Any) -> int | None:
    """The first dimension of the first tensor found in ``data`` (``None`` if there is none)."""
    if isinstance(data, (tuple, list)):
        for item in data:
            size = find_batch_size(item)
            if size is not None:
                return size
        return None
    if isinstance(data, Mapping):
        return find_batch_size(list(data.values()))
    if torch.is_tensor(data):
        return data.shape[0] if data.ndim else None
    return None


def slice_tensors(data: Any, tensor_slice: slice) -> Any:
    """Slice every tensor in ``data`` along its first dimension."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a namedtuple (a tuple with ``_asdict`` and ``_fields``), as Accelerate decides.

    Example:
        >>> import collections
        >>> is_namedtuple(collections.namedtuple("P", "x")(1)), is_namedtuple((1,))
        (True, False)
    """
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def _mapping_like(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` in a mapping of ``template``'s type (as Accelerate rebuilds them)."""
    # Mapping's own __init__ takes nothing, but the mappings batches hold (dict, OrderedDict,
    # BatchEncoding...) are built from a dict.
    return cast(Callable[[dict[Any, Any]], Any], type(template))(items)


def honor_type(obj: Any, generator: Any) -> Any:
    """``generator``'s items in a container of ``obj``'s type (a namedtuple gets them as fields).

    Example:
        >>> honor_type((1, 2), (x * 2 for x in (1, 2)))
        (2, 4)
    """
    return type(obj)(*list(generator)) if is_namedtuple(obj) else type(obj)(generator)


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``."""
    return isinstance(tensor, torch.Tensor)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` (in place, nested dicts merged key by key); returns ``destination``.

    Example:
        >>> merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}, "d": 3})
        {'a': {'c': 2, 'b': 1}, 'd': 3}
    """
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``obj.a.b.c`` for ``attr="a.b.c"``.

    Example:
        >>> recursive_getattr(torch.nn.Sequential(torch.nn.Linear(1, 2)), "0.out_features")
        2
    """
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _to_list(tensor: torch.Tensor) -> Any:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # .tolist() has no bf16 path
        tensor = tensor.to(torch.float32)
    return tensor.tolist()


def listify(data: Any) -> Any:
    """Every tensor in ``data`` as nested Python lists (or a number, for a 0-d tensor), the structure kept.

    Example:
        >>> listify({"a": torch.tensor([1, 2]), "b": (torch.tensor(3.5),)})
        {'a': [1, 2], 'b': (3.5,)}
    """
    return recursively_apply(_to_list, data)


def _is_half(tensor: Any) -> bool:
    return torch.is_tensor(tensor) and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Every fp16/bf16 tensor in ``tensor`` (a nested structure) as float32; other values unchanged.

    Example:
        >>> convert_to_fp32({"x": torch.ones(1, dtype=torch.bfloat16), "n": torch.ones(1, dtype=torch.int64)})
        {'x': tensor([1.]), 'n': tensor([1])}
    """
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad the batch (first dimension, with zeros) to the next multiple of ``num_processes`` above ``batch_size``.

    A batch smaller than ``num_processes`` grows to ``num_processes`` rows, so every process gets
    one. Differs from Accelerate on purpose: Accelerate adds ``num_processes - batch_size //
    num_processes`` rows, which for some sizes (6 over 4 processes: 9 rows) is not a multiple of
    ``num_processes``; the results agree wherever Accelerate's is a multiple.

    Args:
        tensor: a tensor or a nested structure of tensors, all with ``batch_size`` rows.
        batch_size: the rows in the batch.
        num_processes: the processes to split it over.
        dim: the dimension the input is copied along (rows are added along the first one).

    Raises:
        ConfigError: ``num_processes`` is not a positive int.

    Example:
        >>> pad_input_tensors(torch.ones(3, 2), batch_size=3, num_processes=4).shape
        torch.Size([4, 2])
    """
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ConfigError(f"`num_processes` must be a positive int (got {num_processes!r}). Fix: pass the number of "
                          "processes the batch is split over, e.g. `num_processes=accelerator.num_processes`.",
                          key="num_processes", value=num_processes, valid="int >= 1")
    rows = max(num_processes, -(-batch_size // num_processes) * num_processes)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if rows == batch_size:
            return t
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(t.dim()))] = t
        return padded

    return recursively_apply(pad, tensor, error_on_other_type=True)


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or ``None`` where it cannot tell.

    Example:
        >>> ignorant_find_batch_size({"x": torch.ones(3, 2)}), ignorant_find_batch_size("text")
        (3, None)
    """
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


@dataclass
class TensorInformation:
    """A tensor's shape and dtype, without its data (what rank 0 tells the others before a dispatched batch)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """``data`` with every tensor replaced by its :class:`TensorInformation`.

    Example:
        >>> get_data_structure({"x": torch.ones(2, dtype=torch.int8)})
        {'x': TensorInformation(shape=torch.Size([2]), dtype=torch.int8)}
    """
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors of the shapes and dtypes a :func:`get_data_structure` result describes.

    Example:
        >>> initialize_tensors(get_data_structure([torch.ones(3)]))[0].shape
        torch.Size([3])
    """
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)
