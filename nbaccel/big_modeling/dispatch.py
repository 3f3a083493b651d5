"""Dispatching a model over devices with hooks: ``dispatch_model`` and the offload shortcuts.

Each resident device-map entry gets one :class:`AlignDevicesHook`. Entries on an offload device
(disk; also CPU when a GPU executes) keep their weights on the meta device between calls: each
submodule that holds tensors itself gets its own hook, which reads just that submodule's weights
from one :class:`OffloadedWeightsLoader` before it runs and releases them after, so a forward
holds one submodule's weights at a time, not the whole entry's. When they run on a GPU, their
weights stream through a few device slots, one no-split block (a decoder layer) per slot, in the
order the forwards run them, copied on a side stream while the block before them computes
(:mod:`.streamed_offload`, :mod:`.offload_groups`); elsewhere, and whenever a hook loads the
plain way (gradients enabled), each offloaded hook starts reading the next one's weights on a
background thread before it computes. The map is recorded as ``model.hf_device_map``.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from nbaccel.big_modeling.cpu_offload_hook import CpuOffload, UserCpuOffloadHook, default_execution_device
from nbaccel.big_modeling.device_map import check_device_map
from nbaccel.big_modeling.map_devices import MapDevice, map_device
from nbaccel.big_modeling.hooks import AlignDevicesHook, add_hook_to_module
from nbaccel.big_modeling.map_entries import dispatch_entries, has_no_forward
from nbaccel.big_modeling.offload import (
    IndexEntry,
    OffloadedWeightsLoader,
    PrefixedDataset,
    offload_state_dict,
)
from nbaccel.big_modeling.offload_groups import block_of, no_split_classes
from nbaccel.big_modeling.streamed_offload import OFFLOAD_SLOTS, stream_offloaded
from nbaccel.big_modeling.tensors import Device, named_module_tensors, set_module_attribute
from nbaccel.errors import CheckpointMismatchError

__all__ = ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model"]


def _torch_device(device: MapDevice) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _holds_tensors(module: nn.Module) -> bool:
    return next(named_module_tensors(module), None) is not None


def _hook_sites(module: nn.Module, name: str, preload: Sequence[str]
                ) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, module, whole)`` for each module of an offloaded part that gets its own hook.

    The part itself always gets one (it moves the inputs); below it, every submodule that holds
    parameters or buffers directly. A module is loaded whole (``whole=True``, nothing below it
    hooked) when its class is in ``preload`` or when a child that is never called (a
    ``ParameterList``, say) holds tensors its forward uses directly.
    """
    seen: set[int] = set()
    todo = [(name, module)]  # a stack: depth first, children in order
    while todo:
        site, current = todo.pop()
        if id(current) in seen:
            continue  # one module under two names gets one hook
        seen.add(id(current))
        whole = type(current).__name__ in preload or any(
            has_no_forward(c) and _holds_tensors(c) for c in current.children())
        if whole or site == name or _holds_tensors(current):
            yield site, current, whole
        if not whole:
            dot = f"{site}." if site else ""
            todo.extend(reversed([(dot + n, c) for n, c in current.named_children()]))


def _weights_map(model: nn.Module, names: Sequence[str],
                 state_dict: Mapping[str, torch.Tensor] | None,
                 offload_dir: str | os.PathLike | None,
                 offload_index: Mapping[str, IndexEntry] | None) -> OffloadedWeightsLoader:
    """The loader for the offloaded tensors ``names``: given values, the index, or the
    module's own (real) values, in that order."""
    loader = OffloadedWeightsLoader(state_dict=state_dict, save_folder=offload_dir,
                                    index=offload_index)
    tensors = dict(named_module_tensors(model, recurse=True))
    ram = {}
    for name in names:
        if name in loader:
            continue
        if not tensors[name].is_meta:
            ram[name] = tensors[name]
            continue
        raise CheckpointMismatchError(
            f"{name!r} is offloaded but has no weights: it is on the meta device and neither "
            "state_dict nor the offload index holds it. Load the weights first, e.g. with "
            "load_checkpoint_and_dispatch(model, checkpoint, device_map).",
            missing_keys=(name,))
    loader.state_dict.update(ram)
    loader.all_keys = [*loader.state_dict, *(k for k in loader.index if k not in ram)]
    return loader


def _check_loaded(model: nn.Module, names: Sequence[str]) -> None:
    tensors = dict(named_module_tensors(model, recurse=True))
    meta = [n for n in names if tensors[n].is_meta]
    if meta:
        raise CheckpointMismatchError(
            f"{len(meta)} tensor(s) placed on a device are still on the meta device (no "
            f"weights), first {meta[:3]}. Load them first, e.g. with "
            "load_checkpoint_and_dispatch(model, checkpoint, device_map).",
            missing_keys=tuple(meta))


def _chain_prefetch(hooks: Sequence[tuple[AlignDevicesHook, list[str]]],
                    device: torch.device | None = None,
                    blocks: Sequence[str | None] | None = None, slots: int = OFFLOAD_SLOTS) -> None:
    """On a GPU, stream the offloaded hooks' weights through device slots (pinned copies, a
    copy stream), one no-split block (``blocks``, one per hook) per slot; each offloaded hook
    also starts fetching the next one's weights once its own are loaded, which is what runs
    when a hook takes its weights the plain way (no GPU, gradients enabled, a hook that cannot
    stream)."""
    if device is not None and device.type == "cuda":
        stream_offloaded(hooks, device, slots=slots, blocks=blocks)
    for (hook, _), (nxt, names) in itertools.pairwise(hooks):
        prefetch = getattr(nxt.weights_map, "prefetch", None)
        if prefetch is not None and names:
            hook.prefetch = functools.partial(prefetch, names)


def dispatch_model(model: nn.Module, device_map: Mapping[str, Device],
                   main_device: Device | None = None,
                   state_dict: Mapping[str, torch.Tensor] | None = None,
                   offload_dir: str | os.PathLike | None = None,
                   offload_index: Mapping[str, IndexEntry] | None = None,
                   offload_buffers: bool = False,
                   skip_keys: str | Sequence[str] | None = None,
                   preload_module_classes: Sequence[str] | None = None,
                   force_hooks: bool = False,
                   no_split_module_classes: Sequence[str] | None = None,
                   offload_slots: int = OFFLOAD_SLOTS) -> nn.Module:
    """Place a model's parts on their devices and attach the hooks that run it across them.

    Args:
        model: the model, its resident weights loaded (offloaded ones may be on meta).
        device_map: ``{module or tensor name: device}``.
        main_device: where offloaded parts run; the first GPU in the map, else CPU.
        state_dict: values for offloaded tensors, kept in RAM.
        offload_dir: an offload folder (``index.json`` and ``.dat``/safetensors references).
        offload_index: an index to use instead of ``offload_dir/index.json``.
        offload_buffers: offload the buffers of offloaded parts too.
        skip_keys: keyword arguments of ``forward`` the hooks leave where they are.
        preload_module_classes: class names whose instances load all their submodules'
            weights at the start of their forward, for modules that use a child's weights
            without calling it (``self.dense.weight``). Others load one submodule at a time.
        force_hooks: attach hooks even when everything is on one device.
        no_split_module_classes: nbaccel's addition: classes whose offloaded weights stream as
            one group (with a transformers model's ``_no_split_modules``), so a decoder layer is
            copied in one go, not norm by norm.
        offload_slots: nbaccel's addition: how many offloaded blocks the execution GPU holds at
            once (one computing, the rest on their way).

    Returns:
        The model, with ``model.hf_device_map``.

    Raises:
        DeviceMapError: the map does not fit the model, or splits a module's own tensors.
        CheckpointMismatchError: a placed tensor has no weights (still on meta).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> x = torch.ones(1, 2); ref = model(x)
        >>> model = dispatch_model(model, {"0": "cpu", "1": "disk"})
        >>> model[1].weight.device.type, torch.equal(model(x), ref)
        ('meta', True)
    """
    checked = check_device_map(model, device_map, on_this_machine=True)
    devices = set(checked.values())
    alone = main_device is None or devices == {map_device(main_device, on_this_machine=False)}
    if len(devices) == 1 and devices != {"disk"} and not force_hooks and alone:
        device = next(iter(devices))
        if device != "meta":
            _check_loaded(model, [n for n, _ in named_module_tensors(model, recurse=True)])
            model.to(_torch_device(device))
        set_module_attribute(model, "hf_device_map", dict(checked))
        return model
    if main_device is None:
        main_device = next((d for d in checked.values() if d not in ("cpu", "disk")), "cpu")
    main = map_device(main_device)
    offloaded = ("disk",) if main in ("cpu", "mps") else ("cpu", "disk")
    preload = list(preload_module_classes or ())
    sites = []  # (entry, hook site, device, whole, full names of the tensors the hook moves)
    for name, (device, whole) in dispatch_entries(model, checked).items():
        module = model.get_submodule(name)
        for site, sub, place in (_hook_sites(module, name, preload) if device in offloaded
                                 and whole else [(name, module, whole)]):
            dot = f"{site}." if site else ""
            sites.append((name, site, device, place, [dot + n for n, _ in named_module_tensors(
                sub, include_buffers=offload_buffers, recurse=place)]))
    offloaded_names = [n for *_, d, _, names in sites if d in offloaded for n in names]
    _check_loaded(model, [n for *_, d, _, names in sites if d not in offloaded and d != "meta"
                          for n in names])
    loader = _weights_map(model, offloaded_names, state_dict, offload_dir, offload_index) \
        if offloaded_names else None
    chain, blocks, no_split = [], [], no_split_classes(model, no_split_module_classes)
    for _entry, site, device, place, names in sites:
        offload = device in offloaded
        weights: Mapping[str, torch.Tensor] | None = None  # no loader: no offloaded site has a tensor
        if offload and loader is not None:
            weights = PrefixedDataset(loader, f"{site}.") if site else loader
        hook = AlignDevicesHook(
            execution_device=_torch_device(main if offload else device), offload=offload,
            io_same_device=not site, weights_map=weights,
            offload_buffers=offload_buffers, place_submodules=place, skip_keys=skip_keys)
        add_hook_to_module(model.get_submodule(site), hook, append=True)
        if offload and names:
            chain.append((hook, [n[len(site) + 1 if site else 0:] for n in names]))
            blocks.append(block_of(model, site, no_split))
    if not any(site == "" for _, site, *_ in sites):
        add_hook_to_module(model, AlignDevicesHook(io_same_device=True, skip_keys=skip_keys),
                           append=True)
    _chain_prefetch(chain, _torch_device(main), blocks, offload_slots)
    set_module_attribute(model, "hf_device_map", dict(checked))
    return model


def _offload_every_module(model: nn.Module, execution_device: torch.device,
                          weights: Mapping[str, torch.Tensor], offload_buffers: bool,
                          preload_module_classes: Sequence[str] | None) -> None:
    chain, blocks, no_split = [], [], no_split_classes(model, None)
    for name, module, whole in _hook_sites(model, "", list(preload_module_classes or ())):
        names = [n for n, _ in named_module_tensors(module, include_buffers=offload_buffers,
                                                    recurse=whole)]
        view = PrefixedDataset(weights, f"{name}.") if name else weights
        hook = AlignDevicesHook(execution_device, offload=True, io_same_device=not name,
                                weights_map=view, offload_buffers=offload_buffers,
                                place_submodules=whole)
        add_hook_to_module(module, hook, append=True)
        if names:
            chain.append((hook, names))
            blocks.append(block_of(model, name, no_split))
    _chain_prefetch(chain, execution_device, blocks)


def cpu_offload(model: nn.Module, execution_device: Device | None = None,
                offload_buffers: bool = False,
                state_dict: Mapping[str, torch.Tensor] | None = None,
                preload_module_classes: Sequence[str] | None = None) -> nn.Module:
    """Keep every weight in CPU RAM and load each module's onto ``execution_device`` as it runs.

    Args:
        model: the model.
        execution_device: where modules run (the first GPU by default, else CPU).
        offload_buffers: offload buffers too.
        state_dict: the weights to use (default: the model's own, moved to CPU).
        preload_module_classes: class names whose instances load all their submodules'
            weights at once (see :func:`dispatch_model`).

    Returns:
        The model.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2)); x = torch.ones(1, 2)
        >>> ref = model(x); model = cpu_offload(model, "cpu")
        >>> torch.equal(model(x), ref)
        True
    """
    device = _torch_device(map_device(execution_device)) \
        if execution_device is not None else default_execution_device()
    if state_dict is None:
        state_dict = {n: t.to("cpu") for n, t in named_module_tensors(model, recurse=True)}
    _offload_every_module(model, device, OffloadedWeightsLoader(state_dict=state_dict),
                          offload_buffers, preload_module_classes)
    set_module_attribute(model, "hf_device_map", {"": "cpu"})
    return model


def disk_offload(model: nn.Module, offload_dir: str | os.PathLike,
                 execution_device: Device | None = None, offload_buffers: bool = False,
                 preload_module_classes: Sequence[str] | None = None) -> nn.Module:
    """Write the weights to ``offload_dir`` (unless it already holds them) and run from there.

    Args:
        model: the model.
        offload_dir: the offload folder; reused as it is when it has an ``index.json``.
        execution_device: where modules run (the first GPU by default, else CPU).
        offload_buffers: offload buffers too.
        preload_module_classes: class names whose instances load all their submodules'
            weights at once (see :func:`dispatch_model`).

    Returns:
        The model.

    Example:
        >>> import tempfile
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2)); x = torch.ones(1, 2)
        >>> ref = model(x); model = disk_offload(model, tempfile.mkdtemp(), "cpu")
        >>> torch.equal(model(x), ref)
        True
    """
    if not os.path.exists(os.path.join(offload_dir, "index.json")):
        offload_state_dict(offload_dir, dict(named_module_tensors(model, recurse=True)))
    device = _torch_device(map_device(execution_device)) \
        if execution_device is not None else default_execution_device()
    _offload_every_module(model, device, OffloadedWeightsLoader(save_folder=offload_dir),
                          offload_buffers, preload_module_classes)
    set_module_attribute(model, "hf_device_map", {"": "disk"})
    return model


def cpu_offload_with_hook(model: nn.Module, execution_device: Device | None = None,
                          prev_module_hook: UserCpuOffloadHook | None = None
                          ) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep a whole model on CPU and move it to ``execution_device`` when called (pipelines).

    Returns:
        ``(model, hook)``; ``hook.offload()`` sends the model back to CPU, and passing it as
        the next model's ``prev_module_hook`` does that automatically.

    Example:
        >>> a, hook_a = cpu_offload_with_hook(torch.nn.Linear(2, 2), "cpu")
        >>> b, hook_b = cpu_offload_with_hook(torch.nn.Linear(2, 2), "cpu", prev_module_hook=hook_a)
        >>> b(a(torch.ones(1, 2))).shape
        torch.Size([1, 2])
    """
    device = _torch_device(map_device(execution_device)) \
        if execution_device is not None else None
    hook = CpuOffload(execution_device=device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)
