"""Seeding and RNG state: `set_seed`, `synchronize_rng_states`, and the snapshot a checkpoint stores.

A snapshot holds Python's, NumPy's, torch's CPU and (where present) CUDA or XLA generator
states, so a resumed run draws the same random numbers (dropout, shuffling) as the original.
"""

from __future__ import annotations

import enum
import random as _py_random
from collections.abc import Iterable
from typing import Any, Literal, cast, get_args

import numpy as np
import torch

from nbaccel.errors import ConfigError

__all__ = ["RNGType", "RngType", "capture_rng_state", "restore_rng_state", "set_seed", "synchronize_rng_state",
           "synchronize_rng_states"]

RngType = Literal["torch", "cuda", "xla", "generator"]


class RNGType(str, enum.Enum):
    """Accelerate's ``RNGType``. nbaccel synchronizes ``TORCH``, ``CUDA``, ``XLA`` and ``GENERATOR``; the
    other members name hardware it has no engine for, and :func:`synchronize_rng_states` refuses them."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU, CUDA, XLA) in this process.

    Args:
        seed: the seed.
        device_specific: add the process index, so each process draws differently.
        deterministic: also ask torch for deterministic algorithms.

    Example:
        >>> set_seed(0); a = torch.rand(1); set_seed(0)
        >>> bool(torch.rand(1) == a)
        True
    """
    if device_specific:
        from nbaccel.process_state import ProcessState

        seed += ProcessState().process_index
    _py_random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily: nothing here initializes CUDA or poisons fork
    xm = _xla_model()
    if xm is not None:
        xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _cuda_device_count() -> int:
    from nbaccel.hardware import cuda_device_count

    return cuda_device_count()


def _xla_model() -> Any:
    """``torch_xla.core.xla_model`` when the XLA runtime is in use in this thread, else ``None``.

    Only inside an XLA replica, or where the runtime was already started: after a TPU launch
    the notebook has torch_xla imported but must never start the runtime itself (it would then
    hold the TPU, and the next launch is refused until a restart), and ``xm.set_rng_state``
    would start it.
    """
    import sys

    if "torch_xla" not in sys.modules:
        return None
    from nbaccel.hardware import xla_runtime_initialized

    xla_launch = sys.modules.get("nbaccel.launch.xla.launcher")
    in_replica = xla_launch is not None and xla_launch.current_replica() is not None
    if not (in_replica or xla_runtime_initialized()):
        return None
    import torch_xla.core.xla_model as xm

    return xm


def _numpy_state_as_plain_values() -> tuple[Any, ...]:
    """NumPy's legacy RNG state with its key as a list of ints: loadable with ``weights_only=True`` anywhere."""
    # legacy=True gives the 5-tuple; numpy's stub unions it with the dict that legacy=False gives.
    state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    name, key, pos, has_gauss, cached_gaussian = state
    return (name, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian))


def _numpy_state_from_plain_values(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """Back to what ``np.random.set_state`` takes; also accepts the array form Accelerate writes."""
    name, key, *rest = state
    return (name, np.asarray(key, dtype=np.uint32), *rest)


def capture_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """A snapshot of every RNG of this process (plus ``generators`` by name).

    Example:
        >>> snap = capture_rng_state(); x = torch.rand(2); restore_rng_state(snap)
        >>> bool((torch.rand(2) == x).all())
        True
    """
    state: dict[str, Any] = {
        "random_state": _py_random.getstate(),
        "numpy_random_seed": _numpy_state_as_plain_values(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # `is_available()` would poison fork in a notebook
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    xm = _xla_model()
    if xm is not None:
        state["xm_seed"] = xm.get_rng_state()
    for name, gen in (generators or {}).items():
        state[f"generator:{name}"] = gen.get_state()
    return state


def restore_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Put back a :func:`capture_rng_state` snapshot (and the named ``generators`` it holds)."""
    _py_random.setstate(state["random_state"])
    np.random.set_state(_numpy_state_from_plain_values(state["numpy_random_seed"]))
    torch.set_rng_state(state["torch_manual_seed"])
    if "torch_cuda_manual_seed" in state and _cuda_device_count() > 0:  # set lazily: CUDA stays uninitialized
        torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])
    xm = _xla_model()
    if "xm_seed" in state and xm is not None:
        xm.set_rng_state(state["xm_seed"])
    for name, gen in (generators or {}).items():
        key = f"generator:{name}"
        if key in state:
            gen.set_state(state[key])


def synchronize_rng_states(rng_types: Iterable[RngType | str | enum.Enum], generator: torch.Generator | None = None
                           ) -> None:
    """Give every process the main process's RNG state, for each kind in ``rng_types``.

    Call it on every process (it is a collective); in one process it changes nothing.

    Args:
        rng_types: ``"torch"`` (CPU generator), ``"cuda"``, ``"xla"``, ``"generator"`` (``generator``).
            Enum members (Accelerate's ``RNGType``) count by their value.
        generator: the generator to synchronize for ``"generator"``.

    Raises:
        ConfigError: an unknown RNG kind, or ``"generator"`` without a ``generator``.

    Example:
        >>> synchronize_rng_states(["torch"])   # one process: nothing to do
    """
    for rng_type in rng_types:
        _synchronize(rng_type.value if isinstance(rng_type, enum.Enum) else rng_type, generator)


def synchronize_rng_state(rng_type: RngType | str | enum.Enum, generator: torch.Generator | None = None) -> None:
    """Accelerate's single-kind form of :func:`synchronize_rng_states`.

    Example:
        >>> synchronize_rng_state(RNGType.TORCH)   # one process: nothing to do
    """
    synchronize_rng_states([rng_type], generator=generator)


def _synchronize(rng_type: str, generator: torch.Generator | None) -> None:
    from nbaccel.ops import broadcast
    from nbaccel.process_state import ProcessState

    valid = get_args(RngType)
    if rng_type not in valid:
        raise ConfigError(f"`rng_types` items must be one of {list(valid)} (got {rng_type!r}); "
                          "use 'torch' for the CPU generator", key="rng_types", value=rng_type, valid=valid)
    if rng_type == "generator" and generator is None:
        raise ConfigError("synchronize_rng_states(['generator']) needs the generator: pass generator=...",
                          key="generator", value=None, valid="a torch.Generator")
    state = ProcessState()
    if state.num_processes == 1:
        return
    xm = _xla_model() if rng_type == "xla" else None
    if rng_type == "xla" and xm is None:
        raise ConfigError("synchronize_rng_states(['xla']) needs torch_xla in use in this process; "
                          "synchronize 'torch' instead", key="rng_types", value=rng_type, valid=valid)
    if rng_type == "torch":
        rng = torch.get_rng_state()
    elif rng_type == "cuda":
        rng = torch.cuda.get_rng_state()
    elif xm is not None:  # rng_type "xla", checked above
        rng = torch.tensor(xm.get_rng_state())
    else:
        assert generator is not None  # rng_type "generator": checked above
        rng = generator.get_state()
    # `broadcast` carries a CPU state through the device when the group needs it (NCCL) and returns it on CPU.
    rng = broadcast(rng, from_process=0).cpu()
    if rng_type == "torch":
        torch.set_rng_state(rng)
    elif rng_type == "cuda":
        torch.cuda.set_rng_state(rng)
    elif xm is not None:
        xm.set_rng_state(int(rng.item()))
    else:
        assert generator is not None
        generator.set_state(rng)
