"""Whether the CUDA driver was initialized in this process, by any library, asked without initializing it.

Fork is unsafe once *any* library has called ``cuInit`` here (torch, CuPy, JAX, Numba,
TensorFlow, PyCUDA, cuda-python, ...): every forked child then fails at its first CUDA call.
torch's own flags (``torch.cuda.is_initialized()``, its bad-fork mark) only see torch, so the
question is put to the driver itself:

1. Is ``libcuda.so`` mapped into this process (``/proc/self/maps``)? If not, nobody can have
   initialized CUDA here, and nothing is loaded to find out.
2. If it is, the already-loaded library (``dlopen`` with ``RTLD_NOLOAD``, so nothing new is
   loaded) is asked ``cuDeviceGetCount``: every driver entry point but ``cuInit`` and
   ``cuDriverGetVersion`` answers ``CUDA_ERROR_NOT_INITIALIZED`` (3) until ``cuInit`` has run,
   and does not initialize anything by being asked.

What always holds: nothing here calls ``cuInit`` or loads a library that was not loaded; the
answer is the same whatever Python modules are imported. Which library did it is a guess from
the imported modules, named only where one candidate stands out.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass

__all__ = ["CudaDriverState", "cuda_driver_state", "likely_cuda_users"]

_CUDA_ERROR_NOT_INITIALIZED = 3
_LIBCUDA = re.compile(r"/libcuda\.so(\.[0-9.]+)?$")
# Imported module -> the library a user would recognise; the first ones are the usual suspects in a notebook.
_CUDA_USERS = (("cupy", "CuPy"), ("jax", "JAX"), ("numba.cuda", "Numba"), ("tensorflow", "TensorFlow"),
               ("pycuda", "PyCUDA"), ("cuda", "cuda-python"), ("cudf", "cuDF"), ("paddle", "PaddlePaddle"),
               ("mxnet", "MXNet"), ("triton", "Triton"), ("torch", "torch"))


@dataclass(frozen=True)
class CudaDriverState:
    """What the CUDA driver says about this process.

    Attributes:
        library: the path of the mapped ``libcuda.so`` (``None``: not loaded here).
        initialized: whether ``cuInit`` has run in this process.
        status: the ``CUresult`` of the question (``None`` when the library is not loaded).
    """

    library: str | None
    initialized: bool
    status: int | None


def _libcuda_loaded() -> bool:
    """Whether the dynamic loader has libcuda here, asked by its soname without loading it (40 us)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            return True
        except OSError:
            continue
    return False


def _mapped_libcuda(maps_path: str = "/proc/self/maps") -> str | None:
    if maps_path == "/proc/self/maps" and not _libcuda_loaded():
        return None  # the usual answer, without reading thousands of lines of maps (0.6 ms with torch loaded)
    try:
        with open(maps_path) as maps:
            text = maps.read()
    except OSError:  # no procfs (not Linux): fork is not used there anyway
        return None
    if "libcuda.so" not in text:  # the usual answer, without splitting thousands of lines
        return None
    for line in text.splitlines():
        path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
        if _LIBCUDA.search(path):
            return path
    return None


def cuda_driver_state() -> CudaDriverState:
    """Ask the CUDA driver, if some library loaded it here, whether ``cuInit`` has run in this process.

    Example:
        >>> cuda_driver_state()   # no library loaded libcuda here
        CudaDriverState(library=None, initialized=False, status=None)
    """
    path = _mapped_libcuda()
    if path is None:
        return CudaDriverState(None, False, None)
    try:  # RTLD_NOLOAD: only a handle on the copy already mapped; never load a driver here
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count = ctypes.c_int(0)
        status = int(driver.cuDeviceGetCount(ctypes.byref(count)))
    except (OSError, AttributeError):  # unmapped since, or not a CUDA driver after all
        return CudaDriverState(path, False, None)
    return CudaDriverState(path, status != _CUDA_ERROR_NOT_INITIALIZED, status)


def likely_cuda_users(exclude: tuple[str, ...] = ()) -> list[str]:
    """The CUDA-using libraries imported in this process, by their usual names (``["CuPy"]``).

    Args:
        exclude: names to leave out (e.g. ``("torch",)`` when torch is known not to have done it).

    Example:
        >>> "CuPy" in likely_cuda_users()
        False
    """
    found: list[str] = []
    for module, name in _CUDA_USERS:
        if module in sys.modules and name not in exclude and name not in found:
            found.append(name)
    return found
