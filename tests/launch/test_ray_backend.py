"""The Ray backend where no Ray cluster runs: missing Ray, config rules, and the ranks' numbering.

The launches themselves run in tests/ray (a two-node cluster in a loopback-only namespace).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nbaccel import ConfigError, LaunchConfig
from nbaccel.config import load_config, save_config
from nbaccel.launch.ray.cluster import RankSite, layout_ranks


def _without_ray(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``import ray`` fails, as where Ray is not installed."""
    prelude = "import sys\nsys.modules['ray'] = None  # makes `import ray` raise ImportError\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_without_ray_the_launcher_and_the_pool_say_what_to_install():
    done = _without_ray("""
        from nbaccel import notebook_launcher, WorkerPool, MissingDependencyError
        for start in (lambda: notebook_launcher(print, num_processes=2, backend="ray"),
                      lambda: WorkerPool(2, backend="ray")):
            try:
                start()
            except MissingDependencyError as exc:
                print("REFUSED:", exc)
        """)
    assert done.returncode == 0, done.stderr
    refusals = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refusals) == 2
    for line in refusals:
        assert "Ray is not installed" in line and "pip install 'nbaccel[ray]'" in line


def test_without_ray_the_magic_says_what_to_install_in_one_line():
    done = _without_ray("""
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "nbaccel")
        from IPython.core.error import UsageError
        try:
            ip.run_cell_magic("accel_launch", "-n 2 --backend ray", "print(1)")
        except UsageError as exc:
            print("USAGE:", exc)
        """)
    assert done.returncode == 0, done.stderr
    assert "USAGE: %%accel_launch: backend='ray' runs the workers on a Ray cluster, but Ray is not installed" \
        in done.stdout


def test_backend_and_ray_keys_round_trip_through_the_config_file_and_stay_out_when_unset(tmp_path):
    plain = save_config(LaunchConfig(num_processes=2), tmp_path / "plain.yaml").read_text()
    assert "\nbackend:" not in plain and "ray_" not in plain  # Accelerate's loader rejects keys it does not know
    path = save_config(LaunchConfig(backend="ray", ray_address="ray://head:10001", ray_placement_strategy="SPREAD"),
                       tmp_path / "ray.yaml")
    loaded = load_config(path)
    assert (loaded.backend, loaded.ray_address, loaded.ray_placement_strategy) == ("ray", "ray://head:10001", "SPREAD")


@pytest.mark.parametrize(("settings", "message"), [
    ({"backend": "slurm"}, "'backend' must be one of \\['local', 'ray'\\]"),
    ({"backend": "ray", "ray_placement_strategy": "TIGHT"}, "'ray_placement_strategy' must be one of"),
    ({"backend": "ray", "num_machines": 2, "main_process_ip": "10.0.0.1"}, "num_machines must stay 1"),
    ({"backend": "ray", "distributed_type": "XLA"}, "runs CPU or GPU ranks"),
])
def test_invalid_ray_settings_are_refused_with_a_fix(settings, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(**settings)


def _site(bundle: int, node: str, gpus: tuple[str, ...] = (), cpus: float = 8) -> RankSite:
    return RankSite(bundle=bundle, node_id=node, ip=f"10.0.0.{ord(node[0]) % 50}", pid=100 + bundle,
                    gpu_ids=gpus, node_cpus=cpus)


def test_ranks_are_numbered_by_node_then_by_the_gpu_each_holds():
    # Ray handed out GPUs in no particular order: bundle 0 got GPU 3 of node "a", bundle 2 GPU 1.
    sites = [_site(0, "a", ("3",)), _site(1, "b", ("0",)), _site(2, "a", ("1",)), _site(3, "b", ("2",))]
    layouts = {layout.bundle: layout for layout in layout_ranks(sites)}
    assert [(layouts[b].rank, layouts[b].node_rank, layouts[b].local_rank) for b in range(4)] == \
        [(1, 0, 1), (2, 1, 0), (0, 0, 0), (3, 1, 1)]
    # every rank of a node sees the node's GPUs of the job; LOCAL_RANK indexes its own
    assert (layouts[0].visible_gpus, layouts[2].visible_gpus) == ("1,3", "1,3")
    assert layouts[1].visible_gpus == "0,2"
    assert {layouts[b].local_world_size for b in range(4)} == {2}


def test_cpu_ranks_share_their_nodes_cores_as_threads():
    layouts = layout_ranks([_site(0, "a", cpus=8), _site(1, "a", cpus=8), _site(2, "b", cpus=2)])
    assert [(layout.visible_gpus, layout.threads) for layout in layouts] == [(None, 4), (None, 4), (None, 2)]


def test_a_ray_ranks_capture_never_hands_out_a_display_mark_before_its_frame():
    # The rank writes a display's frame to the control pipe, then its mark to stdout; the launcher
    # publishes at the mark what the frame holds. The actor's reader could read a printed line and
    # the mark in one read() after the frame went in, so a drain took the mark without its frame
    # and the cell lost the display (a fresh-clone CI run saw it; here it struck 3-5 times in 50 000).
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, threading
        from nbaccel.launch.frames import DISPLAY_MARK, FrameReader, write_frame
        from nbaccel.launch.ray.actor import _Capture

        capture, frames, counts = _Capture(1), FrameReader(), {"frames": 0, "marks": 0, "early": 0}

        def take_all():  # the launcher's drains, as often as they come
            while True:
                ctl, out, _, finished = capture.take(0.01)
                counts["frames"] += len(list(frames.feed(ctl)))
                counts["marks"] += out.count(DISPLAY_MARK)
                if counts["marks"] > counts["frames"]:
                    counts["early"] += 1
                    counts["frames"] = counts["marks"]
                if finished:
                    return

        taker = threading.Thread(target=take_all)
        taker.start()
        for i in range(50_000):  # the rank: a line, a display (frame, then mark), a line
            os.write(1, b"before\\n")
            write_frame(capture.ctl_w, "display", {"i": i})
            os.write(1, DISPLAY_MARK)
            os.write(1, b"after\\n")
        capture.close()
        taker.join()
        print("early marks", counts["early"], "of", counts["marks"])
        """)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["early", "marks", "0", "of", "50000"]

