"""Which module each entry of a checked device map hooks, one hook per entry, each one that runs.

Dispatching hooks a module per entry; a map whose entries overlap (``{"": "cpu", "b.1": "disk"}``)
or name a container without a forward (a ``ModuleList``) is rewritten first, and one that splits a
module's own tensors over devices is refused. It sits below loading and dispatching alike, so
``load_checkpoint_and_dispatch`` refuses such a map before it reads a byte and then walks one way:
device map, loading, dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from nbaccel.big_modeling.map_devices import MapDevice
from nbaccel.errors import DeviceMapError

__all__ = ["dispatch_entries", "has_no_forward"]


def has_no_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a container whose ``forward`` is ``nn.Module``'s (never called)."""
    return type(module).forward is nn.Module.forward


def _never_called(model: nn.Module, name: str) -> bool:
    """Containers such as ``ModuleList`` have no forward, so a hook on them would never run."""
    modules = dict(model.named_modules(remove_duplicate=False))
    return name in modules and has_no_forward(modules[name])


def _split_overlaps(model: nn.Module, device_map: dict[str, MapDevice]) -> dict[str, MapDevice]:
    """Rewrite a map so each entry can get one hook that runs: no entry lies inside another
    (``{"": "cpu", "b.1": "disk"}`` becomes one entry per piece), and containers without a
    forward (``{"blocks": "disk"}`` for a ``ModuleList``) become one entry per child."""
    changed = True
    while changed:
        changed = False
        for name in list(device_map):
            inner = [k for k in device_map if k != name and (not name or k.startswith(f"{name}."))]
            if not inner and not _never_called(model, name):
                continue
            module = model.get_submodule(name)
            dot = f"{name}." if name else ""
            pieces = [*(n for n, _ in module.named_parameters(recurse=False)),
                      *(n for n, _ in module.named_children()),
                      *(n for n, _ in module.named_buffers(recurse=False))]
            device = device_map.pop(name)
            for piece in pieces:
                device_map.setdefault(dot + piece, device)
            changed = True
            break
    return device_map


def _entries_by_module(model: nn.Module, device_map: Mapping[str, MapDevice]
                       ) -> dict[str, tuple[MapDevice, bool]]:
    """``{module name: (device, whole)}``: a whole-module entry, or one module's direct tensors
    (``whole=False``), which must then share one device."""
    modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    hooks: dict[str, tuple[MapDevice, bool]] = {}
    for name, device in device_map.items():
        if name in modules:
            hooks[name] = (device, True)
            continue
        owner = name.rpartition(".")[0]
        if owner in hooks and hooks[owner][0] != device:
            raise DeviceMapError(
                f"the device map puts tensors of module {owner!r} on different devices "
                f"({hooks[owner][0]!r} and {device!r} for {name!r}); a module's own tensors "
                f"must share a device. Map the module instead: {{{owner!r}: 'cpu'}}.",
                key=name, value=device, valid=[hooks[owner][0]])
        hooks[owner] = (device, False)
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return dict(sorted(hooks.items(), key=lambda kv: order[kv[0]]))


def dispatch_entries(model: nn.Module, device_map: Mapping[str, MapDevice]
                      ) -> dict[str, tuple[MapDevice, bool]]:
    """The entries ``dispatch_model`` hooks, ``{module name: (device, whole)}``, for a checked
    map; checking one before loading anything means a bad map leaves the model untouched.

    Raises:
        DeviceMapError: the map splits one module's own tensors over devices.
    """
    return _entries_by_module(model, _split_overlaps(model, dict(device_map)))
