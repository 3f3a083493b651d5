"""A prepared loader's epoch count after ``skip_first_batches``, and its lifetime after ``free_memory``, as in
Accelerate."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")


def fresh_accelerator(library: str):
    lib = importlib.import_module(library)
    if library == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return lib, lib.Accelerator(cpu=True)


def counted(library: str) -> dict:
    lib, accelerator = fresh_accelerator(library)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    list(loader), list(loader)
    skipped = lib.skip_first_batches(loader, 2)
    before = skipped.iteration
    batches = [b.tolist() for b in skipped]
    return {"before": before, "batches": batches, "after": skipped.iteration}


def test_a_skipped_loader_keeps_the_epoch_count():
    ours, theirs = counted("nbaccel"), counted("accelerate")
    assert ours == theirs == {"before": 2, "batches": [[4, 5], [6, 7], [8, 9]], "after": 3}


def freed(library: str) -> dict:
    _, accelerator = fresh_accelerator(library)
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    for _ in loader:
        break  # left mid-pass, as after an exception or an early stop
    references = (weakref.ref(loader), weakref.ref(model))
    del loader, model
    accelerator.free_memory()
    gc.collect()
    return {"alive": [r() is not None for r in references], "registered": len(accelerator._dataloaders)}


def test_free_memory_lets_a_loader_left_mid_pass_go():
    ours, theirs = freed("nbaccel"), freed("accelerate")
    assert ours == theirs == {"alive": [False, False], "registered": 0}


def dropped(library: str, mid_pass: bool) -> dict:
    """A prepared loader's life once the code holds it no more, with the cyclic collector off."""
    _, accelerator = fresh_accelerator(library)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    for _ in loader:
        if mid_pass:
            break
    gc.collect()
    gc.disable()  # reference counting alone must free it, as in a notebook between collections
    try:
        reference = weakref.ref(loader)
        del loader
        kept_by_registry = reference() is not None  # accelerator._dataloaders, in both
        accelerator._dataloaders.clear()
        after_registry = reference() is not None
        reference = weakref.ref(accelerator.prepare(DataLoader(list(range(4)), batch_size=2)))
        del accelerator  # a notebook cell run again makes a new Accelerator
        after_accelerator = reference() is not None
    finally:
        gc.enable()
    return {"kept_by_registry": kept_by_registry, "after_registry": after_registry,
            "after_accelerator": after_accelerator}


@pytest.mark.parametrize("mid_pass", [False, True])
def test_a_dropped_loader_is_freed_by_reference_counting(mid_pass):
    ours, theirs = dropped("nbaccel", mid_pass), dropped("accelerate", mid_pass)
    assert ours == theirs == {"kept_by_registry": True, "after_registry": False,
                              "after_accelerator": False}


def registered_then_dropped(library: str) -> dict:
    """A loader registered with the gradient state (as a pass does when it starts) and then dropped."""
    _, accelerator = fresh_accelerator(library)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    accelerator._dataloaders.clear()
    accelerator.gradient_state._add_dataloader(loader)
    active = accelerator.gradient_state.active_dataloader is loader
    reference = weakref.ref(loader)
    del loader
    gc.collect()
    return {"active while alive": active, "freed": reference() is None,
            "active after": accelerator.gradient_state.active_dataloader}


def test_the_gradient_state_holds_loaders_weakly():
    ours, theirs = registered_then_dropped("nbaccel"), registered_then_dropped("accelerate")
    assert ours == theirs == {"active while alive": True, "freed": True, "active after": None}


def base_dataloaders(library: str) -> dict:
    data_loader = importlib.import_module(f"{library}.data_loader")
    loaders = {"skip": data_loader.SkipDataLoader(range(16), batch_size=4, skip_batches=2),
               "shard": data_loader.DataLoaderShard(range(16), batch_size=4),
               "dispatcher": data_loader.DataLoaderDispatcher(range(16), batch_size=4)}
    seen = {name: isinstance(loader.base_dataloader, DataLoader) for name, loader in loaders.items()}
    try:
        data_loader.DataLoaderShard.base_dataloader  # noqa: B018 - an instance's attribute, not the class's
        seen["on the class"] = "found"
    except AttributeError:
        seen["on the class"] = "AttributeError"
    return seen


def test_every_loader_has_a_base_dataloader_as_in_accelerate():
    assert base_dataloaders("nbaccel") == base_dataloaders("accelerate") == {
        "skip": True, "shard": True, "dispatcher": True, "on the class": "AttributeError"}
