"""One LaunchRequest: precedence resolved once, the launcher chosen by name, the two multi-machine bugs."""

from __future__ import annotations

import os

import pytest

from nbaccel import ConfigError, LaunchConfig, notebook_launcher
from nbaccel.launch import (
    Launcher,
    LaunchRequest,
    build_request,
    launch,
    register_launcher,
)
from nbaccel.launch.registry import available_launchers, launcher_for

TWO_MACHINES = dict(num_machines=2, main_process_ip="10.0.0.7", main_process_port=29411, rdzv_backend="c10d")


def test_explicit_arguments_win_over_the_config_and_the_request_is_resolved_once():
    cfg = LaunchConfig(num_processes=3, mixed_precision="fp16", use_cpu=True)
    request = build_request(print, (1,), {"sep": ""}, config=cfg, num_processes=2, output_ranks=1, return_all=True)
    assert isinstance(request, LaunchRequest)
    assert (request.num_processes, request.config.mixed_precision, request.plan.settings.mixed_precision) == \
        (2, "fp16", "fp16")
    assert (request.launcher, request.output_ranks, request.args, dict(request.kwargs)) == \
        ("local", frozenset({1}), (1,), {"sep": ""})


def test_the_configs_rendezvous_backend_reaches_a_multi_machine_request():
    request = build_request(print, config=LaunchConfig(num_processes=1, use_cpu=True, **TWO_MACHINES))
    assert request.launcher == "elastic"
    assert request.rendezvous.backend == "c10d"  # was "static": notebook_launcher's default won
    assert request.rendezvous.endpoint == "10.0.0.7:29411"
    explicit = build_request(print, config=LaunchConfig(num_processes=1, use_cpu=True, **TWO_MACHINES),
                             rdzv_backend="static")
    assert explicit.rendezvous.backend == "static" and explicit.rendezvous.conf == {"rank": 0}


def test_an_explicit_master_addr_wins_over_the_configs_address():
    cfg = LaunchConfig(num_processes=1, use_cpu=True, **TWO_MACHINES)
    request = build_request(print, config=cfg, master_addr="127.0.0.1")
    assert request.config.main_process_ip == "127.0.0.1"  # was ignored: the config's address won
    assert request.rendezvous.endpoint == "127.0.0.1:29411"


def test_a_bad_rendezvous_backend_in_the_config_layer_is_named():
    with pytest.raises(ConfigError) as info:
        build_request(print, config=LaunchConfig(num_processes=1, use_cpu=True, **TWO_MACHINES), rdzv_backend="etcd")
    assert info.value.key == "rdzv_backend" and info.value.valid == ("static", "c10d")


class _InProcess:
    """A launcher that runs the function here, as rank 0 of 1: the smallest Launcher there is."""

    name = "test_inprocess"

    def launch(self, request):
        return {0: request.function(*request.args, **request.kwargs)}


def test_a_registered_launcher_runs_a_request_by_name():
    register_launcher(_InProcess())
    request = build_request(lambda x: x * 2, (21,), num_processes=1, use_cpu=True, launcher="test_inprocess")
    assert isinstance(launcher_for("test_inprocess"), Launcher)
    assert launch(request) == 42
    assert {"local", "xla", "elastic", "test_inprocess"} <= set(available_launchers())


def test_an_unknown_launcher_is_a_config_error_listing_the_valid_ones():
    request = build_request(print, num_processes=1, use_cpu=True, launcher="warm_pool_not_yet")
    with pytest.raises(ConfigError) as info:
        launch(request)
    assert info.value.key == "launcher" and info.value.value == "warm_pool_not_yet"
    assert "local" in info.value.valid and "xla" in info.value.valid
    with pytest.raises(ConfigError) as info:
        launcher_for("supervisor")  # a module of nbaccel.launch, but not a launcher
    assert info.value.key == "launcher"


def test_registering_something_that_is_not_a_launcher_is_refused():
    with pytest.raises(ConfigError) as info:
        register_launcher(object())  # type: ignore[arg-type]  # the wrong type is the test
    assert info.value.key == "launcher"


def _world() -> tuple[int, str]:
    return int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"]


def test_notebook_launcher_runs_a_request_built_from_its_arguments():
    assert notebook_launcher(_world, num_processes=2, config=LaunchConfig(num_processes=3)) == (2, "127.0.0.1")


def test_the_builtin_table_names_every_backend_module_and_only_those():
    """Each row's module defines BACKEND under that name; no backend module is missing from the table."""
    import importlib.util
    from pathlib import Path

    import nbaccel.launch
    from nbaccel.launch.registry import BACKENDS

    for module in BACKENDS.values():
        assert importlib.util.find_spec(module) is not None
    here = Path(nbaccel.launch.__file__).parent
    defining = {"nbaccel.launch." + ".".join(path.relative_to(here).with_suffix("").parts)
                for path in here.rglob("*.py") if "\nBACKEND = " in path.read_text()}
    assert defining == set(BACKENDS.values())
    assert launcher_for("local").name == "local"


def test_plan_launch_refuses_an_xla_config_which_the_xla_backend_plans():
    from nbaccel.launch.preflight import plan_launch

    with pytest.raises(ConfigError, match="xla backend") as caught:
        plan_launch(LaunchConfig(distributed_type="XLA"))
    assert caught.value.key == "distributed_type"


def test_a_pool_on_a_backend_that_keeps_no_ranks_warm_is_refused(monkeypatch):
    from nbaccel.launch import registry
    from nbaccel.launch.backend import Backend
    from nbaccel.launch.pool import WorkerPool

    monkeypatch.setitem(registry._registered, "local", Backend(_InProcess()))  # a launcher that took the name
    with pytest.raises(ConfigError, match="keeps no ranks warm") as caught:
        WorkerPool(num_processes=1, use_cpu=True)
    assert caught.value.value == "local"
