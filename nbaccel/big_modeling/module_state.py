"""What a (possibly offloaded or tied) model holds: its buffers, its full state dict, its ties, its device map.

Accelerate's helpers for these, with its names and results: buffer sets and sizes, sizes with
tied parameters, a state dict read module by module out of offload, re-tying after a load, the
sub-state-dict of some submodules, whether a module is offloaded (and onloading it for a block),
and merging a device map's entries where a whole subtree sits on one device.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from nbaccel.big_modeling.hooks import AlignDevicesHook
from nbaccel.big_modeling.offload import load_offloaded_weight
from nbaccel.big_modeling.sizes import compute_module_sizes, get_max_layer_size
from nbaccel.big_modeling.tensors import set_module_tensor_to_device

__all__ = [
    "align_module_device",
    "calculate_maximum_sizes",
    "check_tied_parameters_on_same_device",
    "clean_state_dict_for_safetensors",
    "clean_device_map",
    "compute_module_total_buffer_size",
    "extract_submodules_state_dict",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_module_children_bottom_up",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "load_offloaded_weights",
    "retie_parameters",
]

logger = logging.getLogger(__name__)


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of ``module``'s buffers left out of its state dict (``persistent=False``).

    Args:
        module: the module.
        recurse: also look in every submodule.
        fqns: with ``recurse``, give full dotted names (otherwise the bare buffer names).

    Example:
        >>> m = nn.Module(); m.register_buffer("mask", torch.ones(1), persistent=False)
        >>> get_non_persistent_buffers(m)
        {'mask'}
    """
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            if fqns and prefix:
                names |= {f"{prefix}.{b}" for b in sub._non_persistent_buffers_set}
            else:
                names |= sub._non_persistent_buffers_set
    return names


def compute_module_total_buffer_size(model: nn.Module, dtype: torch.dtype | str | None = None,
                                     special_dtypes: Mapping[str, torch.dtype] | None = None) -> int:
    """Bytes of all of ``model``'s buffers (cast to ``dtype`` where given, as in :func:`compute_module_sizes`).

    Example:
        >>> compute_module_total_buffer_size(nn.BatchNorm1d(4))
        40
    """
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_module_size_with_ties(tied_params: Sequence[str], module_size: int, module_sizes: Mapping[str, int],
                              modules_to_treat: Sequence[tuple[str, nn.Module]]
                              ) -> tuple[int, list[str], list[nn.Module]]:
    """A module's size plus the modules its tied parameters live in (less the tied tensors, counted once).

    Args:
        tied_params: the names of the module's parameters tied to ones elsewhere.
        module_size: the module's own size.
        module_sizes: from :func:`compute_module_sizes`.
        modules_to_treat: the ``(name, module)`` pairs still to place; each tied parameter's
            module is looked up there.

    Returns:
        ``(size with ties, names of the tied modules, the tied modules)``.

    Example:
        >>> get_module_size_with_ties([], 10, {}, [])
        (10, [], [])
    """
    names: list[str] = []
    modules: list[nn.Module] = []
    size = module_size
    for param in tied_params:
        name, module = next((n, m) for n, m in modules_to_treat if param == n or param.startswith(n + "."))
        names.append(name)
        modules.append(module)
        size += module_sizes[name] - module_sizes[param]
    return size, names, modules


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` carries an :class:`AlignDevicesHook` with ``offload=True`` (its weights live elsewhere).

    Example:
        >>> has_offloaded_params(nn.Linear(1, 1))
        False
    """
    return _offload_hook(module) is not None


def _offload_hook(module: nn.Module) -> AlignDevicesHook | None:
    """``module``'s :class:`AlignDevicesHook` when it has one with ``offload=True``."""
    hook = getattr(module, "_hf_hook", None)
    return hook if isinstance(hook, AlignDevicesHook) and hook.offload else None


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: torch.device | str | None = None) -> Iterator[None]:
    """Within the block, ``module``'s parameters are real tensors on its execution device (or ``execution_device``).

    An offloaded module is loaded as for a forward and released after; another module's
    parameters are moved to ``execution_device`` and back. Without either it does nothing.

    Example:
        >>> lin = nn.Linear(1, 1)
        >>> with align_module_device(lin, "meta"):
        ...     lin.weight.device.type
        'meta'
    """
    hook = _offload_hook(module)
    if hook is not None:
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
    elif execution_device is not None:
        devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
        saved = {name: p.data for name, p in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                value = saved[name] if devices[name].type != "meta" else None
                set_module_tensor_to_device(module, name, device, value=value)
    else:
        yield


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model whose modules may be offloaded, onloading one module at a time, on CPU.

    Tensors that stay on the meta device (never loaded) are left out, with a warning naming them.

    Example:
        >>> sorted(get_state_dict_offloaded_model(nn.Sequential(nn.Linear(1, 1))))
        ['0.bias', '0.weight']
    """
    state_dict: dict[str, torch.Tensor] = {}
    placeholders: set[str] = set()
    for name, module in model.named_modules():
        if name == "":
            continue
        with align_module_device(module, "cpu"):
            module_state = module.state_dict()
        for key, tensor in module_state.items():
            if tensor.device == torch.device("meta"):
                placeholders.add(f"{name}.{key}")
                continue
            state_dict[f"{name}.{key}"] = tensor.to("cpu")
    missing = sorted(placeholders - set(state_dict))
    if missing:
        logger.warning("These tensors were not saved because they are on the meta device: %s", missing)
    return state_dict


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return module, leaf


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Tie again each group of ``tied_params`` (from :func:`find_tied_parameters`) to the group's first real tensor.

    A load that replaces tensors one by one (or onto meta) breaks ties; this restores them.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> retie_parameters(m, [["0.weight", "1.weight"]]); m[0].weight is m[1].weight
        True
    """
    for group in tied_params:
        real = next((getattr(*_owner(model, n)) for n in group if getattr(*_owner(model, n)).device.type != "meta"),
                    None)
        if real is not None:
            for name in group:
                setattr(*_owner(model, name), real)


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor],
                                  submodule_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to the named submodules (keys kept whole).

    Example:
        >>> extract_submodules_state_dict({"a.w": 1, "ab.w": 2, "b": 3}, ["a"])
        {'a.w': 1}
    """
    result: dict[str, torch.Tensor] = {}
    for module_name in submodule_names:
        result.update({k: v for k, v in state_dict.items() if k == module_name or k.startswith(module_name + ".")})
    return result


def clean_device_map(device_map: dict[str, int | str | torch.device], module_name: str = ""
                     ) -> dict[str, int | str | torch.device]:
    """Merge the entries of ``device_map`` under ``module_name`` into one wherever they share a device (in place).

    Example:
        >>> clean_device_map({"a.0": 0, "a.1": 0, "b": "cpu"})
        {'b': 'cpu', 'a': 0}
    """
    prefix = f"{module_name}." if module_name else ""
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for key in [k for k in device_map if k.startswith(prefix)]:
            del device_map[key]
        device_map[module_name] = values[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {".".join(k.split(".")[:depth])
                for k in device_map if k.startswith(prefix) and len(k) > len(module_name)}
    for child in children:
        clean_device_map(device_map, module_name=child)
    return device_map


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list:
    """Every module of ``model``, children before their parents (``(name, module)`` pairs with ``return_fqns``).

    Example:
        >>> [n for n, _ in get_module_children_bottom_up(nn.Sequential(nn.Linear(1, 1)), return_fqns=True)]
        ['0', '']
    """
    stack: list[tuple[str, nn.Module]] = [("", model)]
    ordered: list[tuple[str, nn.Module]] = []
    while stack:
        name, module = stack.pop()
        stack.extend((f"{name}.{child}" if name else child, sub) for child, sub in module.named_children())
        ordered.append((name, module))
    ordered.reverse()
    return ordered if return_fqns else [m for _, m in ordered]


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, storage address, storage bytes)``: equal for tensors that share their storage (ties, views).

    Example:
        >>> w = torch.ones(4); id_tensor_storage(w[:2]) == id_tensor_storage(w)
        True
    """
    storage = tensor.untyped_storage()
    try:
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):  # meta tensors have no address
        return tensor.device, 0, tensor.nelement() * tensor.element_size()


def _device_of(name: str, device_map: Mapping[str, object]) -> object:
    while name not in device_map:
        if name == "":
            raise ValueError(f"The `device_map` does not contain the module {name}.")
        name = name.rpartition(".")[0]  # "" (the whole model) last
    return device_map[name]


def check_tied_parameters_on_same_device(tied_params: Sequence[Sequence[str]],
                                          device_map: Mapping[str, object]) -> None:
    """Warn (in the log, as Accelerate does) about tied parameters that ``device_map`` puts on different devices."""
    for group in tied_params:
        devices = {name: _device_of(name, device_map) for name in group}
        if len(set(map(str, devices.values()))) > 1:
            logger.warning("Tied parameters are on different devices: %s. Please modify your custom device map or "
                           "set `device_map='auto'`.", devices)


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total bytes, (bytes of the largest layer, its names))``, no-split blocks from ``model._no_split_modules``.

    Example:
        >>> calculate_maximum_sizes(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 4)))
        (72, (48, ['1']))
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    pieces: list[tuple[str, nn.Module | torch.Tensor]] = [
        *model.named_parameters(recurse=False), *model.named_children(), *model.named_buffers(recurse=False)]
    return sizes[""], get_max_layer_size(pieces, sizes, no_split)


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """``state_dict`` ready for safetensors: of tensors sharing storage only the first name kept (logged),
    all contiguous.

    Example:
        >>> w = torch.ones(2, 2); sorted(clean_state_dict_for_safetensors({"a": w, "b": w, "c": w.t()}))
        ['a']
    """
    by_storage: dict[tuple, list[str]] = collections.defaultdict(list)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, str):
            by_storage[id_tensor_storage(tensor)].append(name)
    removed = {name for names in by_storage.values() if len(names) > 1 for name in names[1:]}
    for name in removed:
        del state_dict[name]
    if removed:
        logger.warning("Removed shared tensor %s while saving. This should be OK, but check by verifying that you "
                       "don't receive any warning while reloading", removed)
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def load_offloaded_weights(model: nn.Module, index: Mapping[str, dict] | None,
                           offload_folder: str | os.PathLike) -> None:
    """Load the weights an offload ``index`` lists (``<name>.dat`` files in ``offload_folder``) into ``model`` on CPU.

    Differs from Accelerate: bitsandbytes ``SCB`` statistics are not handled (nbaccel does not
    wrap bitsandbytes); such entries are skipped, as Accelerate skips them as weights.
    """
    for name, entry in (index or {}).items():
        if "SCB" in name:
            continue
        weight = load_offloaded_weight(os.path.join(offload_folder, f"{name}.dat"), entry)
        set_module_tensor_to_device(model, name, "cpu", value=weight)
