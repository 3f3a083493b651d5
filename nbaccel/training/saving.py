"""`save`: Accelerate's replacement for ``torch.save`` in a job, which writes once per job (or once per machine).

Every process may call it; only the main process (or, with ``save_on_each_node``, each
machine's local main process) writes, so ranks never race on one file.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["save"]


def save(obj: Any, f: str | os.PathLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` from the main process only (``torch.save``, or safetensors with ``safe_serialization``).

    Args:
        obj: what to save; with ``safe_serialization``, a dict of tensors.
        f: the file.
        save_on_each_node: write on each machine's local main process (for disks not shared).
        safe_serialization: write a safetensors file (metadata ``{"format": "pt"}``, as Accelerate's); of
            tensors sharing storage only the first name is written, and the others are logged.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.pt"
        >>> save({"w": torch.ones(1)}, path); torch.load(path)
        {'w': tensor([1.])}
    """
    from nbaccel.process_state import ProcessState

    state = ProcessState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if state.device.type == "xla":
        import torch_xla.core.xla_model as xm

        obj = xm._maybe_convert_to_cpu(obj)
    if safe_serialization:
        from safetensors.torch import save_file

        from nbaccel.big_modeling.module_state import clean_state_dict_for_safetensors

        # safetensors refuses tensors that share storage (tied weights); keep one name each, as Accelerate does
        save_file(clean_state_dict_for_safetensors(dict(obj)), f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)
