"""A two-node Ray cluster for the tests in this folder, kept on loopback.

Ray listens on every interface and talks to this machine's own address, so these tests run
only inside a network namespace whose one interface is loopback (``scripts/test_ray.sh`` makes
one with ``unshare -n``); anywhere else they are skipped. The cluster is
``ray.cluster_utils.Cluster``: two nodes of 2 CPUs each, so a 4-rank job spans both.
"""

from __future__ import annotations

import socket

import pytest


def only_loopback() -> bool:
    """Whether this process's network namespace has no interface but ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def pytest_collection_modifyitems(config, items):
    if only_loopback():
        return
    skip = pytest.mark.skip(reason="Ray tests run only in a loopback-only network namespace: bash scripts/test_ray.sh")
    for item in items:
        if "tests/ray/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """A connected two-node cluster (2 CPUs each) for the whole session."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def live_actors() -> list:
    """Actors of the cluster that are not dead (nbaccel's rank actors are the only ones the tests start)."""
    from ray.util.state import list_actors

    return [a for a in list_actors(limit=1000) if a.state != "DEAD"]


def live_placement_groups() -> list:
    from ray.util.state import list_placement_groups

    return [p for p in list_placement_groups(limit=1000) if p.state != "REMOVED"]


def wait_until_clean(timeout: float = 20.0) -> tuple[list, list]:
    """Wait for every actor to be dead and every placement group removed; what is left after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        actors, groups = live_actors(), live_placement_groups()
        if (not actors and not groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.2)
