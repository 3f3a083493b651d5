"""Fake NVIDIA driver libraries, compiled here with gcc: a GPU machine as the dynamic loader sees it.

``libnvidia-ml.so.1`` answers NVML's questions for ``$FAKE_NVML_GPUS`` GPUs (default 2) named
"NVIDIA H200" with UUIDs ``GPU-fake-0``, ``GPU-fake-1``, ...; ``libcuda.so.1`` is a CUDA driver
whose entry points answer ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` runs, as the real one
does. A process started with ``LD_LIBRARY_PATH`` on the folder finds them where it would find
the real ones: nothing in nbaccel is told it is being tested.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int gpus(void) { const char *n = getenv("FAKE_NVML_GPUS"); return n ? atoi(n) : 2; }
int nvmlInit(void) { return 0; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = (unsigned int)gpus(); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if ((int)index >= gpus()) return 2;
    *handle = (void *)(size_t)(index + 1); return 0;
}
int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    snprintf(uuid, length, "GPU-fake-%d", (int)(size_t)handle - 1); return 0;
}
int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    (void)handle; snprintf(name, length, "NVIDIA H200"); return 0;
}
int nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor) {
    (void)handle; *major = 9; *minor = 0; return 0;
}
int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    snprintf(version, length, "580.95.05"); return 0;
}
"""

_CUDA = r"""
static int initialized = 0;
int cuInit(unsigned int flags) { (void)flags; initialized = 1; return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
int cuDeviceGetCount(int *count) { if (!initialized) return 3; *count = 1; return 0; }
"""


def build_fake_driver(folder: Path) -> Path:
    """Compile both libraries into ``folder`` and return it (for ``LD_LIBRARY_PATH``)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("the fake GPU driver needs gcc (CI has it)")
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in (("libnvidia-ml.so.1", _NVML), ("libcuda.so.1", _CUDA)):
        c_file = folder / f"{name}.c"
        c_file.write_text(source)
        subprocess.run([gcc, "-shared", "-fPIC", "-o", str(folder / name), str(c_file)], check=True)
    return folder
