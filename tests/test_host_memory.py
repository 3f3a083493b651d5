"""The memory a process may still take: cgroup v1 and v2 limits read from files laid out as the
kernel lays them out (written here under a temporary root), and this machine's own cgroup; free
memory, a process's resident memory and its descriptors as psutil tells them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from nbaccel.big_modeling.pinned_slabs import pinned_cap
from nbaccel.hardware import available_cpu_memory
from nbaccel.host_memory import available_memory, cgroup_memory, open_descriptors, resident_bytes

GiB = 2**30
V1_UNLIMITED = "9223372036854771712"


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _proc(root: Path, cgroup: str, mounts: list[str]) -> Path:
    """``/proc/self`` as the kernel writes it, mount points under ``root``."""
    proc = root / "proc" / "self"
    _files(root, {"proc/self/cgroup": cgroup})
    lines = [f"{30 + k} 23 0:{28 + k} {m.format(root=root)}" for k, m in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc


def test_a_v2_limit_on_a_parent_binds_and_inactive_page_cache_does_not_count(tmp_path) -> None:
    proc = _proc(tmp_path, "0::/user.slice/app.scope\n",
                 ["/ {root}/sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"])
    group = tmp_path / "sys/fs/cgroup"
    _files(group, {
        "memory.max": "max\n", "memory.current": "9000000000\n",  # the root: no limit
        "user.slice/memory.max": f"{4 * GiB}\n", "user.slice/memory.current": f"{3 * GiB}\n",
        "user.slice/memory.stat": f"anon {2 * GiB}\nfile {GiB}\ninactive_file {GiB}\n",
        "user.slice/app.scope/memory.max": "max\n", "user.slice/app.scope/memory.current": "1\n",
    })
    found = cgroup_memory(str(proc))
    assert found is not None and found.layout == "v2"
    assert Path(found.path) == group / "user.slice" and found.limit == 4 * GiB
    assert found.headroom == 2 * GiB  # 4 GiB - (3 GiB used - 1 GiB reclaimable cache)
    assert available_memory(str(proc), free=20 * GiB) == 2 * GiB


def test_a_v1_memory_controller_limit_is_read_from_its_own_mount(tmp_path) -> None:
    proc = _proc(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n", [
        "/ {root}/sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
        "/ {root}/sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
        "/ {root}/sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw",  # hybrid: no memory files there
    ])
    memory = tmp_path / "sys/fs/cgroup/memory"
    _files(memory, {
        "memory.limit_in_bytes": V1_UNLIMITED + "\n", "memory.usage_in_bytes": "1\n",
        "docker/memory.limit_in_bytes": V1_UNLIMITED + "\n", "docker/memory.usage_in_bytes": "1\n",
        "docker/abc/memory.limit_in_bytes": f"{8 * GiB}\n",
        "docker/abc/memory.usage_in_bytes": f"{7 * GiB}\n",
        "docker/abc/memory.stat": f"cache {3 * GiB}\ninactive_file 5\ntotal_inactive_file {2 * GiB}\n",
    })
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)
    found = cgroup_memory(str(proc))
    assert found is not None and found.layout == "v1" and Path(found.path) == memory / "docker/abc"
    assert found.headroom == 3 * GiB
    assert available_memory(str(proc), free=20 * GiB) == 3 * GiB


def test_a_container_without_a_cgroup_namespace_reads_the_mount_it_sees(tmp_path) -> None:
    # Docker on v1 without cgroupns: /proc/self/cgroup names the host's path, which is mounted as root
    proc = _proc(tmp_path, "4:memory:/docker/abc\n",
                 ["/docker/abc {root}/sys/fs/cgroup/memory ro - cgroup cgroup rw,memory"])
    _files(tmp_path / "sys/fs/cgroup/memory", {"memory.limit_in_bytes": f"{GiB}\n",
                                               "memory.usage_in_bytes": f"{GiB // 4}\n"})
    found = cgroup_memory(str(proc))
    assert found is not None and found.headroom == 3 * GiB // 4


def test_no_limit_or_no_cgroup_leaves_meminfo(tmp_path) -> None:
    proc = _proc(tmp_path, "0::/\n", ["/ {root}/sys/fs/cgroup rw - cgroup2 cgroup2 rw"])
    _files(tmp_path / "sys/fs/cgroup", {"memory.max": "max\n", "memory.current": "1\n"})
    assert cgroup_memory(str(proc)) is None
    assert available_memory(str(proc), free=5 * GiB) == 5 * GiB
    assert cgroup_memory(str(tmp_path / "nowhere")) is None  # not Linux, no procfs


def test_free_memory_resident_memory_and_descriptors_are_what_the_kernel_says(tmp_path) -> None:
    free = available_memory(str(tmp_path / "nowhere"))  # no cgroup: the kernel's MemAvailable
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert abs(free - int(meminfo["MemAvailable"].split()[0]) * 1024) < 256 * 2**20
    vm_rss = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    assert abs(resident_bytes() - int(vm_rss.split()[1]) * 1024) < 64 * 2**20
    before = open_descriptors()
    with open(__file__):
        assert open_descriptors() == before + 1 == len(os.listdir("/proc/self/fd"))
    assert open_descriptors() == before


def test_a_finished_or_dead_process_has_no_resident_memory() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident_bytes(pid) is None  # a zombie: /proc shows no VmRSS
    os.waitpid(pid, 0)
    assert resident_bytes(pid) is None  # gone


def test_this_machines_cgroup_is_read_and_caps_the_pinned_memory() -> None:
    found = cgroup_memory()
    if found is not None:  # a limited container: the limit is the file's, and it caps the pinning
        limit_file = "memory.max" if found.layout == "v2" else "memory.limit_in_bytes"
        assert int(Path(found.path, limit_file).read_text()) == found.limit
        assert pinned_cap(1.0) <= found.limit
    else:  # no limit anywhere up this process's v1 memory cgroup (v2: "max")
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            limit = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes")
            if "memory" in controllers.split(",") and limit.exists():
                assert int(limit.read_text()) >= 2**60
    assert pinned_cap(1.0) > 0 and available_cpu_memory() > 0


def test_a_first_launchs_preflight_does_not_import_psutil() -> None:
    """Free memory and open descriptors come from /proc on Linux: psutil's 20-50 ms import stays off a first launch."""
    code = ("import sys; from nbaccel.launch import build_request;"
            "build_request(print, num_processes=2, use_cpu=True); print('psutil' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_meminfo_and_psutil_agree_on_free_memory() -> None:
    assert abs(available_memory("/nonexistent", free=None) - psutil.virtual_memory().available) < 256 * 2**20
