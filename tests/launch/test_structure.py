"""The launching side's shape: no import cycle (imports inside functions count), no private names crossing modules."""

from __future__ import annotations

import ast
from pathlib import Path

import nbaccel

PACKAGE = Path(nbaccel.__file__).parent
CHECKED = ("nbaccel.launch", "nbaccel.cli", "nbaccel.magics", "nbaccel.identity", "nbaccel.state", "nbaccel.ops",
           "nbaccel.environment", "nbaccel.config", "nbaccel.process_state", "nbaccel.rank_resets")


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
    graph = {m: {t for t, _ in _imports(p, modules) if _checked(t) and t != m} for m, p in modules.items() if _checked(m)}

    def visit(node: str, path: list[str], done: set[str]) -> None:
        for target in sorted(graph.get(node, ())):
            assert target not in path, "import cycle: " + " -> ".join(path[path.index(target):] + [target])
            if target not in done:
                visit(target, path + [target], done)
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
