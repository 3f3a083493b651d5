"""Check loading a checkpoint straight onto a GPU through pinned staging buffers (no GPU in CI).

Run: ``python scripts/check_gpu_loading.py [--mib 512]``, or call :func:`check_gpu_loading`
from ``scripts/check_gpu.py``. It prints ``ok`` lines or exits with ``FAILED``; well under a
minute on one GPU. ``--cpu`` runs the streaming checks' logic on CPU (no GPU needed). It checks
what the CPU suite cannot:

1. ``read_to_device`` onto ``cuda:0`` gives the file's exact bytes, for every chunking: tensors
   smaller than, equal to and spanning several reader buffers, and empty ones.
2. The reader buffers are pinned and the copies are asynchronous: a load through them is not
   slower than a plain ``safetensors`` load followed by ``.to("cuda")`` (times printed).
3. ``load_checkpoint_and_dispatch(model, folder, {"": 0})`` and a GPU/CPU split give outputs
   bit-identical to the model loaded with a plain ``load_state_dict`` and moved to the GPU;
   a ``dtype`` change happens on the GPU and matches a cast of the stored values.
4. The streamed offload (``gpu_checks/streaming_checks.py``): pinned slabs, prefetch order,
   wrap-around, no host synchronization, the pinned memory cap, GPU memory, bit-identical
   outputs over CPU and disk offload, with a small batch and with one large enough that each
   layer's compute overlaps the next layer's copy (a missing wait on either side must show).
5. The order on a transformers decoder (``gpu_checks/decoder_order_checks.py``): one group per
   decoder layer, each copied once per forward with no demand miss, also across ``generate()``
   steps, tokens identical to the model held whole, and ``offload_report``'s line.
6. Host memory (``gpu_checks/host_memory_checks.py``): exact-size registered buffers are pinned,
   copied from as fast as torch's pinned memory, and given back by ``unpin``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_checks


def _check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok   {name} {detail}")


class _Stack(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.blocks(x)))


def _write(folder: Path, mib: int) -> tuple[_Stack, int]:
    import safetensors.torch

    width = 1024
    blocks = max(2, mib // 4)  # 4 MiB of fp32 weights per block
    torch.manual_seed(0)
    model = _Stack(blocks, width).eval()
    state = model.state_dict()
    names, weight_map = list(state), {}
    for s in range(4):
        file = f"model-{s}.safetensors"
        safetensors.torch.save_file({n: state[n].contiguous() for n in names[s::4]},
                                    str(folder / file))
        weight_map.update(dict.fromkeys(names[s::4], file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model, blocks


def _check_staging(folder: Path) -> None:
    import safetensors.torch

    from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
    from nbaccel.big_modeling.resident import read_to_device

    odd = {"a": torch.randn(3, 1000), "b": torch.arange(7, dtype=torch.int64), "c": torch.ones(0),
           "d": torch.randn(4096, dtype=torch.float64).to(torch.bfloat16)}
    safetensors.torch.save_file(odd, str(folder / "odd.safetensors"))
    infos = SafetensorsFile(folder / "odd.safetensors").tensors
    for size in (8, 4096, 12000, 2**26):
        out = read_to_device([infos[k] for k in odd], "cuda:0", buffer_bytes=size)
        same = all(t.device.type == "cuda" and torch.equal(t.cpu(), odd[k])
                   for k, t in zip(odd, out))
        _check(f"staged read onto cuda:0 is exact with {size}-byte buffers", same)


def _timed_loads(folder: Path) -> None:
    import safetensors.torch

    from nbaccel.big_modeling.checkpoint_files import SafetensorsFile
    from nbaccel.big_modeling.resident import read_to_device

    files = sorted(folder.glob("model-*.safetensors"))
    infos = [i for f in files for i in SafetensorsFile(f).tensors.values()]
    times: dict[str, list[float]] = {"staged": [], "plain": []}
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged = read_to_device(infos, "cuda:0")
        torch.cuda.synchronize()
        times["staged"].append(time.perf_counter() - start)
        del staged
        start = time.perf_counter()
        plain = [t.to("cuda:0") for f in files for t in safetensors.torch.load_file(f).values()]
        torch.cuda.synchronize()
        times["plain"].append(time.perf_counter() - start)
        del plain
    best = {k: min(v) for k, v in times.items()}
    gib = sum(i.nbytes for i in infos) / 2**30
    _check("staged load not slower than load_file + .to('cuda')",
           best["staged"] <= 1.1 * best["plain"],
           f"(staged {best['staged']:.3f}s, plain {best['plain']:.3f}s for {gib:.2f} GiB)")


def _check_dispatch(folder: Path, full: _Stack, blocks: int) -> None:
    from nbaccel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = full.to("cuda:0")(x.to("cuda:0")).cpu()
        half = full.to(torch.float16)(x.to("cuda:0", torch.float16)).cpu()
    split = {"blocks": 0, "out": "cpu"} if blocks > 1 else {"": 0}
    for device_map, dtype, expected in (({"": 0}, None, reference), (split, None, reference),
                                        ({"": 0}, torch.float16, half)):
        with init_empty_weights():
            model = _Stack(blocks, 1024).eval()
        model = load_checkpoint_and_dispatch(model, folder, device_map, dtype=dtype)
        with torch.no_grad():
            y = model(x.to("cuda:0", dtype or torch.float32)).cpu()
        _check(f"load_checkpoint_and_dispatch {device_map} dtype={dtype} is bit-identical",
               model.blocks[0].weight.device.type == "cuda" and torch.equal(y, expected),
               f"(max diff {(y.float() - expected.float()).abs().max().item():.3g})")


def _check_streaming(folder: Path, blocks: int, device: torch.device) -> None:
    import safetensors.torch
    from gpu_checks.streaming_checks import check_streaming

    full = _Stack(blocks, 1024).eval()  # fresh from the files: _check_dispatch cast its model
    full.load_state_dict({k: v for f in sorted(folder.glob("model-*.safetensors"))
                          for k, v in safetensors.torch.load_file(str(f)).items()})
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1)).to(device)
    # 8192 rows: a layer's matmul (17 GFLOP) outlasts the next layer's 4 MiB copy on any GPU
    rows = 8192 if device.type == "cuda" else 256
    big = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(2)).to(device)
    resident = 0 if device.type == "cuda" else "cpu"
    maps = {"cpu": {"blocks": "cpu", "out": resident}, "disk": {"blocks": "disk", "out": resident}}
    check_streaming(lambda: _Stack(blocks, 1024), full, folder, maps, x, device, big)


def check_gpu_loading(mib: int = 512, cpu: bool = False) -> None:
    """Run every check above on ``cuda:0``; raises ``SystemExit`` on the first failure.

    Args:
        mib: the checkpoint's size.
        cpu: run only the streaming checks, on CPU (a dry run of their logic).

    Example:
        >>> check_gpu_loading(64)  # doctest: +SKIP
    """
    from gpu_checks.decoder_order_checks import check_decoder_order

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("FAILED: no CUDA device; run this on a machine with a GPU")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        full, blocks = _write(folder, mib)
        if cpu:
            _check_streaming(folder, blocks, torch.device("cpu"))
            check_decoder_order(torch.device("cpu"))
            return
        _check_staging(folder)
        _timed_loads(folder)
        (folder / "odd.safetensors").unlink()
        _check_dispatch(folder, full, blocks)
        _check_streaming(folder, blocks, torch.device("cuda", 0))
        check_decoder_order(torch.device("cuda", 0))
    from gpu_checks.host_memory_checks import check_host_memory

    check_host_memory()  # exact-size registered buffers: pinned, as fast, given back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size for the timing")
    parser.add_argument("--cpu", "--small", action="store_true",
                        help="streaming and decoder-order checks on CPU only (no GPU needed)")
    args = parser.parse_args()
    check_gpu_loading(args.mib, cpu=args.cpu)


if __name__ == "__main__":
    main()
