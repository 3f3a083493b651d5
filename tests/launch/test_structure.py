"""The launching side's shape: no import cycle (imports inside functions count), no private names crossing modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path


import nbaccel

PACKAGE = Path(nbaccel.__file__).parent
CHECKED = ("nbaccel.launch", "nbaccel.cli", "nbaccel.magics", "nbaccel.identity", "nbaccel.state", "nbaccel.ops",
           "nbaccel.environment", "nbaccel.config", "nbaccel.process_state", "nbaccel.process_group")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) for every nbaccel import in ``path``, at any depth (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nbaccel"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, "") if sub in modules else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("nbaccel.")]
    return found


def _checked(name: str) -> bool:
    return any(name == c or name.startswith(c + ".") for c in CHECKED)


def test_no_import_cycle_in_the_launching_side():
    modules = _modules()
    graph = {m: {t for t, _ in _imports(p, modules) if _checked(t) and t != m}
             for m, p in modules.items() if _checked(m)}

    def visit(node: str, path: list[str], done: set[str]) -> None:
        for target in sorted(graph.get(node, ())):
            assert target not in path, "import cycle: " + " -> ".join([*path[path.index(target):], target])
            if target not in done:
                visit(target, [*path, target], done)
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [module], done)


def test_no_private_name_is_imported_across_modules():
    modules = _modules()
    crossing = {(m, name) for m, p in modules.items() if _checked(m)
                for _, name in _imports(p, modules) if name.startswith("_") and not name.endswith("__")}
    assert crossing == set(), sorted(crossing)


def test_the_state_asks_the_identity_not_a_launcher():
    source = (PACKAGE / "process_state.py").read_text()
    assert "nbaccel.launch" not in source and "current_identity" in source


def test_launching_modules_stay_small():
    launch = PACKAGE / "launch"
    sizes = {str(p.relative_to(launch)): len(p.read_text().splitlines()) for p in launch.rglob("*.py")}
    assert max(sizes.values()) <= 400, sizes


# The core: launch/'s top-level modules and the pool's core. Backends are the subpackages below;
# launch/worker/ is the rank side every backend shares, so the core may use it.
BACKEND_PACKAGES = ("nbaccel.launch.ray", "nbaccel.launch.xla", "nbaccel.launch.elastic", "nbaccel.launch.local",
                    "nbaccel.launch.pool")
CORE_ALSO = ("pool/worker_pool.py",)
THE_ONE_REGISTRY = "registry.py"  # its table is the one place in the core that names backends
_MODULE_NAME = re.compile(r"nbaccel(\.\w+)+(:\w+)?")


def _reached(tree: ast.AST) -> set[str]:
    """Every module ``tree`` imports (at any depth) or names in a string constant (``"a.b"``, ``"a.b:Class"``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "nbaccel.launch" \
                else {node.module}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            names.add(node.value.split(":")[0])
    return names


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_core_reaches_no_backend_by_statement_or_string():
    """The core finds backends through the registry's table only.

    Caught on the code before: request.py -> nbaccel.launch.ray.plan (now in ray/launcher.py), preflight.py ->
    nbaccel.launch.xla.topology (imports inside functions), pool/worker_pool.py ->
    "nbaccel.launch.pool.local_ranks:LocalPoolRanks" and "nbaccel.launch.ray.pool:RayPoolRanks" (strings).
    """
    launch = PACKAGE / "launch"
    core = [p for p in launch.glob("*.py") if p.name != THE_ONE_REGISTRY] + [launch / c for c in CORE_ALSO]
    offenders = sorted(f"{p.relative_to(launch)} -> {name}" for p in core for name in _reached(ast.parse(p.read_text()))
                       if _within(name, BACKEND_PACKAGES))
    assert offenders == []


def test_the_backend_check_sees_strings_and_imports_inside_functions():
    source = ("import importlib\nTABLE = {'ray': 'nbaccel.launch.ray.pool:RayPoolRanks'}\n"
              "def f():\n    from nbaccel.launch.xla.topology import check_xla_launch\n"
              "    '''Docs may mention nbaccel.launch.local.launcher in prose.'''\n")
    assert sorted(n for n in _reached(ast.parse(source)) if _within(n, BACKEND_PACKAGES)) == [
        "nbaccel.launch.ray.pool", "nbaccel.launch.xla.topology"]


# The public-name table (name -> defining module): the warm-up imports the names a user's function uses, whichever
# they are, before forking; what it names is the user's choice, not a dependency of launch/.
_DATA_TABLES = {"nbaccel.exports"}


def _bottom_modules_launch_uses() -> list[Path]:
    """launch/'s files, and the modules outside launch/ that they import (what a rank runs through)."""
    launch_files = sorted((PACKAGE / "launch").rglob("*.py"))
    modules = _modules()
    outside = {name for p in launch_files for name in _reached(ast.parse(p.read_text()))
               if name in modules and not _within(name, ("nbaccel.launch",)) and name not in _DATA_TABLES}
    return launch_files + [modules[name] for name in sorted(outside)]


def test_nothing_under_launch_reaches_process_state_by_statement_or_string():
    """launch/ and what it imports never name the process state, so the import graph shows every dependency.

    Caught on the code before: nbaccel/rank_resets.py's GROUP_JOIN_PROVIDER = "nbaccel.process_state", imported by
    name by join_rank_group(), which pool/serve.py and ray/actor.py called (now RankLifecycle.join_group, whose
    rules live in nbaccel/process_group.py, below both).
    """
    offenders = sorted(f"{p.relative_to(PACKAGE)} -> {name}" for p in _bottom_modules_launch_uses()
                       for name in _reached(ast.parse(p.read_text())) if _within(name, ("nbaccel.process_state",)))
    assert offenders == []


# Module-level calls that fill a table when a module is imported.
_IMPORT_TIME_TABLES = re.compile(r"register_\w+|before_each_launch")


def test_no_table_is_filled_at_import_time_but_the_backend_registry():
    """Which hooks run is said where they are used (a backend's fields), not by importing a module.

    Caught on the code before: pool/warm.py's before_each_launch(release_warm_devices), process_state.py's
    register_group_join(join_pool_group), and register_rank_reset(...) in process_state.py, identity.py and
    launch/run_log.py (a rank now starts afresh through the RankLifecycle its request carries).
    """
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and _IMPORT_TIME_TABLES.fullmatch(
                    call.func.id):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {call.func.id}")
    assert offenders == []
