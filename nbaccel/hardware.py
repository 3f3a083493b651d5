"""What hardware and host this process runs on, and whether it may fork: detection only.

Reads the environment (never writes it) and ``/sys`` / ``/dev``, and never initializes CUDA or
the XLA runtime in the calling process, so everything here is safe to call before forking.
``NBACCEL_TPU`` and ``NBACCEL_ASSUME_UNSAFE_FORK`` override what is detected.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from nbaccel.environment import ASSUME_UNSAFE_FORK, FORCE_TPU, env_flag
from nbaccel.host_memory import available_memory, open_descriptors

__all__ = [
    "available_cpu_memory",
    "check_os_kernel",
    "open_file_budget",
    "TPU_ENV_SIGNS",
    "cpu_count",
    "cuda_device_count",
    "cuda_initialized",
    "fork_unsafe_reason",
    "in_colab",
    "in_kaggle",
    "in_notebook",
    "tpu_detected",
    "tpu_device_files",
    "tpu_pci_device_ids",
    "xla_installed",
    "xla_runtime_initialized",
]


def in_notebook() -> bool:
    """Whether we run inside a Jupyter kernel (checked from ``sys.modules``, importing nothing)."""
    ipython = sys.modules.get("IPython")
    if ipython is None or "ipykernel" not in sys.modules:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def in_colab() -> bool:
    """Whether we run in Google Colab."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def in_kaggle() -> bool:
    """Whether we run in a Kaggle kernel."""
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    """Visible CUDA devices, counted without initializing CUDA
    or poisoning fork here (see :mod:`nbaccel.cuda_probe`)."""
    from nbaccel.cuda_probe import cuda_device_count as count

    return count()


def cuda_initialized() -> bool:
    """Whether torch has initialized CUDA in this process (other libraries: :mod:`nbaccel.cuda_driver`)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return bool(torch.cuda.is_initialized())


def xla_installed() -> bool:
    """Whether ``torch_xla`` can be imported (without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def xla_runtime_initialized() -> bool:
    """Whether the XLA runtime has been initialized in this process (torch_xla then refuses to launch).

    Asks ``torch_xla._XLAC._xla_runtime_is_initialized()``, which only reads a flag; when
    torch_xla has not been imported the runtime cannot have started, and nothing is imported.
    """
    if "torch_xla" not in sys.modules:
        return False
    xlac = sys.modules.get("_XLAC") or getattr(sys.modules["torch_xla"], "_XLAC", None)
    probe = getattr(xlac, "_xla_runtime_is_initialized", None)
    return bool(probe()) if probe is not None else False


TPU_ENV_SIGNS = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
                 "TPU_PROCESS_BOUNDS", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG")
"""Environment variables whose presence says this is a TPU machine."""
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICE_IDS = ("0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076")  # torch_xla's list


def tpu_pci_device_ids(root: str = "/") -> list[str]:
    """PCI device ids of the TPU chips on this machine (Google's vendor id, torch_xla's device ids)."""
    found = []
    for vendor_path in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
        try:
            if Path(vendor_path).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            device = Path(vendor_path).with_name("device").read_text().strip()
        except OSError:
            continue
        if device in _TPU_PCI_DEVICE_IDS:
            found.append(device)
    return found


def tpu_detected(env: Mapping[str, str] | None = None, *, root: str = "/") -> bool:
    """Whether a TPU is here, without initializing the XLA runtime (or importing torch_xla).

    ``NBACCEL_TPU=1`` / ``NBACCEL_TPU=0`` decides outright (``1`` also routes a CPU-runtime launch,
    ``PJRT_DEVICE=CPU``, through torch_xla). Otherwise torch_xla must be installed, and then:
    ``PJRT_DEVICE=TPU`` says yes and any other ``PJRT_DEVICE`` (``CPU``, ``CUDA``) says no; the
    variables Colab, Kaggle and TPU VMs set (``TPU_ACCELERATOR_TYPE``, ``TPU_NAME``,
    ``TPU_WORKER_ID``, ``COLAB_TPU_ADDR``, ...), a TPU chip on the PCI bus (how torch_xla itself
    looks), or TPU device files (``/dev/accel0``...) say yes.

    Args:
        env: the environment to read (default ``os.environ``).
        root: the filesystem root holding ``sys/bus/pci`` and ``dev`` (for tests).

    Raises:
        ConfigError: ``NBACCEL_TPU`` holds something other than 0 or 1.

    Example:
        >>> tpu_detected({"NBACCEL_TPU": "0", "PJRT_DEVICE": "TPU"})
        False
    """
    env = os.environ if env is None else env
    if FORCE_TPU in env:
        return env_flag(env, FORCE_TPU)
    if not xla_installed():
        return False
    pjrt = env.get("PJRT_DEVICE", "").strip().upper()
    if pjrt:
        return pjrt.split("_")[0] == "TPU"
    if any(env.get(k) for k in TPU_ENV_SIGNS):
        return True
    if tpu_pci_device_ids(root):
        return True
    return bool(glob.glob(os.path.join(root, "dev/accel[0-9]*")))  # not vfio: GPU passthrough uses it too


def tpu_device_files(root: str = "/") -> list[str]:
    """The TPU device files here: ``/dev/accel*`` (TPU v2-v4) or ``/dev/vfio/<n>`` (v5e and later).

    Example:
        >>> tpu_device_files("/nonexistent")
        []
    """
    found = sorted(glob.glob(os.path.join(root, "dev/accel[0-9]*")))
    return found + sorted(glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))


def fork_unsafe_reason() -> str | None:
    """Why forking this process would break workers, or ``None`` when fork is safe.

    Asked of torch (an initialized CUDA; a parent that only *queried* CUDA, which leaves
    ``torch.cuda.is_initialized()`` False but breaks CUDA in every forked child, seen through one
    throwaway probe fork), of the CUDA driver itself (``cuInit`` run by any library: CuPy, JAX,
    Numba, TensorFlow, ...; see :mod:`nbaccel.cuda_driver`), and of the XLA runtime. The answer
    does not depend on which modules are imported.

    Example:
        >>> fork_unsafe_reason() is None   # a fresh CPU-only process
        True
    """
    if os.environ.get(ASSUME_UNSAFE_FORK, "") == "1":
        return f"{ASSUME_UNSAFE_FORK}=1 is set"
    if not sys.platform.startswith("linux"):
        return f"fork is only used on Linux (this is {sys.platform})"
    if cuda_initialized():
        return "CUDA is already initialized in this process"
    from nbaccel.cuda_probe import cuda_fork_poisoned

    if cuda_fork_poisoned():
        return ("CUDA was queried in this process (torch.cuda.is_available() or a device count without NVML, "
                "perhaps by a library), so forked workers could not use it")
    driver = _cuda_initialized_by_another_library()
    if driver is not None:
        return driver
    if xla_runtime_initialized():
        return "the XLA runtime is already initialized in this process"
    return None


def _cuda_initialized_by_another_library() -> str | None:
    from nbaccel.cuda_driver import cuda_driver_state, likely_cuda_users

    if not cuda_driver_state().initialized:
        return None
    users = likely_cuda_users(exclude=("torch",))  # torch was asked above and did not do it
    if len(users) == 1:
        who = users[0]
    elif users:
        who = f"a library (imported here: {', '.join(users)})"
    else:
        who = "a library that loaded the CUDA driver"
    return f"CUDA was initialized in this process by {who}, so forked workers could not use it"


def available_cpu_memory() -> int:
    """Bytes of memory this process may still take without swapping or being OOM-killed: the
    least of ``MemAvailable`` and its memory cgroup's headroom (see :mod:`nbaccel.host_memory`)."""
    return available_memory()


def open_file_budget() -> tuple[int, int] | None:
    """``(descriptors this process may still open, its limit)``, or ``None`` when unlimited or unknown."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    in_use = open_descriptors()
    if in_use is None:  # pragma: no cover - a system that does not say
        return None
    return max(soft - in_use, 0), soft



MIN_LINUX_KERNEL = (5, 5, 0)
"""Older Linux kernels can hang multi-process jobs (Accelerate warns below this one too)."""


def check_os_kernel(release: str | None = None) -> str | None:
    """Log a warning (and return it) when this Linux kernel is older than :data:`MIN_LINUX_KERNEL`.

    Accelerate's ``check_os_kernel``, a ``WARNING`` record as there; it also returns the message,
    ``None`` when all is well (not Linux, a recent kernel, or a release string without a version).

    Args:
        release: the kernel release to check; ``platform.uname().release`` when ``None``.

    Example:
        >>> check_os_kernel("6.8.0-generic") is None
        True
    """
    import logging
    import platform
    import re

    if release is None:
        if platform.system() != "Linux":
            return None
        release = platform.uname().release
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", release)
    if match is None or tuple(int(g) for g in match.groups()) >= MIN_LINUX_KERNEL:
        return None
    version = match.group()
    msg = (f"Detected kernel version {version}, which is below the recommended minimum of "
           f"{'.'.join(map(str, MIN_LINUX_KERNEL))}; this can cause the process to hang. Fix: upgrade the kernel.")
    logging.getLogger(__name__).warning(msg)
    return msg
