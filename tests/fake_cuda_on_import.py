"""Import first in a subprocess: torch, when something imports it, becomes a CUDA build (faked).

Nothing is imported until then, so the process really is one "that has not imported torch".
When torch is imported, ``tests/fake_cuda_runtime.py`` makes it look CUDA-built, but torch's
own NVML count is kept, so the GPUs it sees are those of the NVML library the dynamic loader
finds (``tests/fake_gpu_driver.py`` on ``LD_LIBRARY_PATH``), with ``CUDA_VISIBLE_DEVICES``
applied by torch itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType


class _FakeCudaAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]  # the import system passes a path list or None
        assert spec is not None and spec.loader is not None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if self in sys.meta_path:  # find_spec alone (importlib.util.find_spec) imports nothing
                sys.meta_path.remove(self)
            run(module)
            real_nvml_count = module.cuda._device_count_nvml
            import tests.fake_cuda_runtime  # noqa: F401 - makes torch CUDA-built

            module.cuda._device_count_nvml = real_nvml_count

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # wrapped on purpose
        return spec


sys.meta_path.insert(0, _FakeCudaAfterImport())
