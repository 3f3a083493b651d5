"""`load_state_dict`: one checkpoint file (safetensors or a torch pickle) read into a state dict on its devices.

Accelerate's ``load_state_dict(checkpoint_file, device_map=None)``: with a device map each tensor
is read onto the device its module is mapped to (``"disk"`` ones onto the CPU, to be offloaded);
torch pickles are read with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from nbaccel.big_modeling.map_devices import device_for
from nbaccel.errors import CheckpointError
from nbaccel.file_kinds import regular_file
from nbaccel.safe_load import load

__all__ = ["load_state_dict"]

logger = logging.getLogger(__name__)


def load_state_dict(checkpoint_file: str | os.PathLike,
                    device_map: Mapping[str, int | str | torch.device] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``checkpoint_file``, on CPU or on the devices ``device_map`` gives their modules.

    Raises:
        CheckpointError: a safetensors file saved for another framework (``format`` not ``"pt"``), or
            ``checkpoint_file`` is not a regular file (a FIFO or device: refused on the open descriptor).

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.bin"; torch.save({"w": torch.ones(1)}, path)
        >>> load_state_dict(path)
        {'w': tensor([1.])}
    """
    path = os.fspath(checkpoint_file)
    with regular_file(path) as name:  # the file checked is the file read
        if not path.endswith(".safetensors"):
            return load(name, map_location="cpu")
        return _read_safetensors(path, name, device_map)


def _read_safetensors(path: str, name: str, device_map: Mapping[str, int | str | torch.device] | None
                      ) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(name, framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format", "pt") != "pt":
            raise CheckpointError(f"{path!r} was saved with format {metadata['format']!r}, not PyTorch's ('pt'). "
                                  "Fix: convert it to a PyTorch checkpoint first.", path=path)
        if not metadata:
            logger.warning("The safetensors archive passed at %s does not contain metadata; reading it as 'pt'.", path)
        result = {}
        for key in f.keys():  # noqa: SIM118 - a safetensors file handle, not a dict: it has keys() only
            device = "cpu" if device_map is None else device_for(key, device_map, "cpu")
            device = "cpu" if device == "disk" else device
            result[key] = f.get_tensor(key).to(device if not isinstance(device, int) else f"cuda:{device}")
    return result
