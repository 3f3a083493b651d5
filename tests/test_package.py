"""The package surface: exported names, typing marker, and a light import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbaccel


def test_all_is_sorted_and_every_name_resolves():
    assert nbaccel.__all__ == sorted(nbaccel.__all__)
    for name in nbaccel.__all__:
        assert getattr(nbaccel, name) is not None, name


def test_accelerate_names_are_exported_at_the_top_level():
    names = {"AcceleratorState", "DistributedType", "PartialState", "find_executable_batch_size",
             "synchronize_rng_states"}
    assert names <= set(nbaccel.__all__)
    assert issubclass(nbaccel.AcceleratorState, nbaccel.PartialState)
    assert issubclass(nbaccel.PartialState, nbaccel.ProcessState)
    assert "utils" not in nbaccel.__all__


def test_accelerates_import_paths_only_re_export():
    """``nbaccel.utils`` / ``hooks`` / ``data_loader`` exist for Accelerate's import lines; they define nothing."""
    import importlib

    for path in ("nbaccel.utils", "nbaccel.hooks", "nbaccel.data_loader"):
        module = importlib.import_module(path)
        assert module.__all__ == sorted(module.__all__)
        defined_here = [n for n in module.__all__ if getattr(getattr(module, n), "__module__", None) == path]
        assert defined_here == [], path
    from nbaccel.state import (  # Accelerate's accelerate.state names
        AcceleratorState,
        GradientState,
        PartialState,
    )

    assert AcceleratorState is nbaccel.AcceleratorState and PartialState is nbaccel.PartialState
    assert GradientState.__module__ == "nbaccel.training.gradient_state"


def test_unknown_attribute_is_an_attribute_error():
    try:
        nbaccel.not_a_name  # noqa: B018
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_pull_ipython_or_widgets():
    code = "import sys, nbaccel; print('IPython' in sys.modules, 'ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_py_typed_ships():
    assert (Path(nbaccel.__file__).parent / "py.typed").exists()


def _nbaccel_imports() -> dict[str, set[str]]:
    """Every module's nbaccel imports, module-level and inside functions alike (``from a import b`` counts a.b or a)."""
    import ast

    root = Path(nbaccel.__file__).parent
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("nbaccel"):
                edges[module] |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                                  for a in node.names}
            elif isinstance(node, ast.Import):
                edges[module] |= {a.name for a in node.names if a.name in modules}
    return {m: {t for t in targets if t in modules and t != m} for m, targets in edges.items()}


def test_no_import_cycle_even_through_imports_inside_functions():
    edges = _nbaccel_imports()
    in_cycle = set()
    for start in edges:  # a module is in a cycle when it can reach itself
        seen, todo = set(), list(edges[start])
        while todo:
            module = todo.pop()
            if module == start:
                in_cycle.add(start)
                break
            if module not in seen:
                seen.add(module)
                todo.extend(edges[module])
    assert sorted(in_cycle) == []


def test_no_private_name_is_imported_across_modules():
    """A leading underscore means "this module's own": another module reaching for it couples the two."""
    import ast

    root = Path(nbaccel.__file__).parent
    crossings = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nbaccel"):
                crossings += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossings == []


def test_every_module_is_small_enough_to_read_in_one_sitting():
    root = Path(nbaccel.__file__).parent
    too_long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > 420}
    assert too_long == {}


def test_only_the_environment_module_writes_os_environ():
    """Workers learn their settings from the environment: one module writes it, so a reader knows where."""
    import re

    root = Path(nbaccel.__file__).parent
    writes = re.compile(r"os\.environ\[[^]]+\]\s*=|os\.environ\.(update|pop|setdefault|clear)\(|del os\.environ|os\.putenv")
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if writes.search(p.read_text()))
    assert writers == ["environment.py"]


def test_the_launch_core_does_not_import_the_training_pillar():
    """launch/ asks machine facts (fp8 support included) of modules below both pillars, never of training/."""
    import ast
    from pathlib import Path

    import nbaccel

    offenders = []
    for path in sorted((Path(nbaccel.__file__).parent / "launch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("nbaccel.training")]
    assert offenders == []
