"""Reading a training-state file without running code from it: `torch.load` with ``weights_only=True``.

Every pickle file ``load_state`` reads (``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``,
``scaler.pt``, ``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``, ``pytorch_model.bin``)
goes through :func:`load_state_file`. By default it unpickles only tensors, numbers, strings,
containers and NumPy arrays (the RNG states Accelerate writes), as Accelerate 1.16's
``accelerate.utils.load`` does; anything else is refused with :class:`UnsafeCheckpointError`
before any of it runs. ``load_kwargs={"weights_only": False}`` (Accelerate's name for the same
opt-in) unpickles everything, for folders you trust.
"""

from __future__ import annotations

import codecs
import pickle
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nbaccel.errors import CheckpointError, UnsafeCheckpointError
from nbaccel.file_kinds import regular_file

__all__ = ["OPT_IN", "SAFE_GLOBALS", "load", "load_state_file"]

OPT_IN = 'load_state(..., load_kwargs={"weights_only": False})'

# What Accelerate 1.16 allows besides torch's own weights-only set: NumPy arrays hold numbers
# only (an object array's items still go through the restricted unpickler), so RNG states
# saved by Accelerate or by older nbaccel versions load without the opt-in.
_np_core = getattr(np, "_core", None) or np.core
SAFE_GLOBALS: list[Any] = [_np_core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
if hasattr(np, "dtypes"):
    SAFE_GLOBALS.append(np.dtypes.UInt32DType)


def _unsafe(path: Path, exc: pickle.UnpicklingError) -> UnsafeCheckpointError:
    text = str(exc)
    found = re.search(r"GLOBAL (\S+)", text)
    reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    what = (f"it names {found.group(1)}" if found else f"the weights-only unpickler stopped at: {reason.group(1)}"
            if reason else "it holds an object torch does not allow")
    return UnsafeCheckpointError(
        f"refused to load {str(path)!r}: it is a pickle that holds more than tensors, numbers and "
        f"containers, and loading it would run code ({what}). Nothing from it was run, and nothing was "
        f"loaded into the model or optimizer. Fix: if you trust whoever wrote this folder, opt in with "
        f"{OPT_IN}; to make your own objects load safely, return only tensors and plain Python values "
        "from their state_dict()", path=str(path))


def load_state_file(path: Path, load_kwargs: Mapping[str, Any] | None = None) -> Any:
    """Unpickle ``path`` onto the CPU, refusing code unless ``load_kwargs`` opts in.

    Args:
        path: the file.
        load_kwargs: extra ``torch.load`` keyword arguments; ``{"weights_only": False}`` allows
            any pickle (it runs the code the file names: only for trusted folders).

    Raises:
        UnsafeCheckpointError: the file needs full unpickling (nothing of it ran).
        CheckpointError: the file is truncated, corrupt, not a torch file, or not a regular file
            (a FIFO, device or directory: refused on the open descriptor, before any read).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "scheduler.bin"; torch.save({"last_epoch": 3}, path)
        >>> load_state_file(path)
        {'last_epoch': 3}
    """
    kwargs = {"map_location": "cpu", "weights_only": True} | dict(load_kwargs or {})
    with regular_file(path) as name:  # a FIFO would block torch.load in C code that Ctrl-C cannot reach
        return _load_checked(path, name, kwargs)


def _load_checked(path: Path, name: str, kwargs: dict[str, Any]) -> Any:
    """``torch.load`` of ``name`` (``path``'s open descriptor), its failures named by ``path``."""
    try:
        if kwargs["weights_only"]:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(name, **kwargs)
        return torch.load(name, **kwargs)
    except pickle.UnpicklingError as exc:
        if kwargs["weights_only"] and "weights_only" in str(exc):
            raise _unsafe(path, exc) from None
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}. Fix: save the checkpoint again, or load an "
                              "earlier one", path=str(path)) from None
    except (RuntimeError, EOFError, ValueError, struct.error, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r} (truncated or corrupt?): {str(exc) or repr(exc)}. "
                              "Fix: save the checkpoint again, or load an earlier one", path=str(path)) from None


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """Accelerate's ``load``: ``torch.load`` with ``weights_only=True`` unless told otherwise, NumPy arrays allowed.

    Unlike :func:`load_state_file`, torch's own errors come through unchanged, as in Accelerate.

    Example:
        >>> import io; buffer = io.BytesIO()
        >>> torch.save({"state": np.arange(2, dtype=np.uint32)}, buffer); _ = buffer.seek(0)
        >>> load(buffer)
        {'state': array([0, 1], dtype=uint32)}
    """
    kwargs.setdefault("weights_only", True)
    if kwargs["weights_only"]:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(f, map_location=map_location, **kwargs)
    return torch.load(f, map_location=map_location, **kwargs)
