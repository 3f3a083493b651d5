"""The package surface: exported names, typing marker, and a light import."""

from __future__ import annotations

import ast
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
        nbaccel.not_a_name  # noqa: B018 - reading the attribute is what must raise
    except AttributeError as exc:
        assert "not_a_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_pull_ipython_or_widgets():
    code = "import sys, nbaccel; print('IPython' in sys.modules, 'ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_subpackages_are_attributes_after_a_plain_import_and_load_only_when_asked():
    code = ("import sys, nbaccel\n"
            "before = sorted(m for m in sys.modules if m.startswith('nbaccel.'))\n"
            "with nbaccel.big_modeling.init_empty_weights():\n"
            "    import torch; layer = torch.nn.Linear(2, 2)\n"
            "print(before, layer.weight.device, nbaccel.utils.set_seed.__name__, nbaccel.hooks.ModelHook.__name__,\n"
            "      nbaccel.state.PartialState is nbaccel.PartialState, nbaccel.data_loader.__name__,\n"
            "      nbaccel.training.__name__, 'big_modeling' in dir(nbaccel))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['nbaccel.exports',", "'nbaccel.version']", "meta", "set_seed", "ModelHook", "True",
                           "nbaccel.data_loader", "nbaccel.training", "True"]


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


# The package's faces: Accelerate's import paths and the entry points. They gather names from every
# folder for users and sit above them all; nothing inside nbaccel imports them (checked below for state).
FACADES = ("nbaccel", "nbaccel.__main__", "nbaccel.data_loader", "nbaccel.hooks", "nbaccel.state", "nbaccel.utils")
# A folder import that closes a cycle, which another part of issue 36 removes (the launch core's own
# code); each must still be there, so its allowance goes as soon as the import does.
KNOWN_BACK_EDGES = {("nbaccel.launch", "nbaccel.runs"): "launch/launcher.py and pool/worker_pool.py start "
                    "background runs (nbaccel.runs.start) from inside the launch core"}


def _folder(module: str) -> str:
    """The folder a module lives in: ``nbaccel`` for the root's modules, else ``nbaccel.<subpackage>``."""
    parts = module.split(".")
    is_package = (Path(nbaccel.__file__).parent.parent.joinpath(*parts) / "__init__.py").exists()
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and is_package) else "nbaccel"


def _folder_imports(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{folder: the other folders its modules import}``, the facades left out."""
    folders: dict[str, set[str]] = {}
    for module, targets in edges.items():
        if module not in FACADES:
            folders.setdefault(_folder(module), set()).update(
                _folder(t) for t in targets if t not in FACADES and _folder(t) != _folder(module))
    return folders


def _folder_cycles(folders: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each set of folders that import each other in a ring (a strongly connected set), sorted."""
    reach: dict[str, set[str]] = {f: set() for f in folders}
    for start in folders:  # what each folder reaches, directly or through others
        todo = list(folders[start])
        while todo:
            folder = todo.pop()
            if folder not in reach[start]:
                reach[start].add(folder)
                todo.extend(folders.get(folder, ()))
    return {tuple(sorted({f} | {g for g in reach[f] if f in reach.get(g, ())})) for f in folders if f in reach[f]}


def test_no_folder_cycle_between_subpackages_and_the_root():
    """Folders form layers: the root's modules, then the pillars, then the front ends; none imports back up."""
    folders = _folder_imports(_nbaccel_imports())
    assert sorted((a, b) for a, b in KNOWN_BACK_EDGES if b not in folders.get(a, ())) == [], \
        "a known back edge is gone: remove its allowance"
    for a, b in KNOWN_BACK_EDGES:
        folders[a].discard(b)
    assert sorted(_folder_cycles(folders)) == []


def test_the_folder_check_sees_a_cycle_through_an_import_inside_a_function():
    edges = {"nbaccel.errors": set(), "nbaccel.partial_state": {"nbaccel.training.process_helpers"},
             "nbaccel.training.process_helpers": {"nbaccel.errors"}, "nbaccel.widgets.config_panel":
             {"nbaccel.magics.session"}, "nbaccel.magics.session": set(), "nbaccel.magics.magics":
             {"nbaccel.widgets.config_panel"}, "nbaccel.utils": {"nbaccel.training.process_helpers"}}
    assert _folder_cycles(_folder_imports(edges)) == {("nbaccel", "nbaccel.training"),
                                                      ("nbaccel.magics", "nbaccel.widgets")}


def test_one_module_asks_psutil_and_one_loads_nvml():
    """Process and memory facts come from host_memory.py alone (psutil, and on Linux the two /proc facts a first
    launch's preflight reads without psutil's import); NVML is loaded by cuda_probe.py alone."""
    root = Path(nbaccel.__file__).parent
    psutil_users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                          if "psutil" in _imported_names(ast.parse(p.read_text())))
    nvml_loaders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "libnvidia-ml" in p.read_text())
    proc_readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                          if any(f in p.read_text() for f in ("VmRSS", "MemAvailable:", "/proc/meminfo\"")))
    assert (psutil_users, nvml_loaders, proc_readers) == (["host_memory.py"], ["cuda_probe.py"], ["host_memory.py"])


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
    writes = re.compile(r"os\.environ\[[^]]+\]\s*=|os\.environ\.(update|pop|setdefault|clear)\("
                        r"|del os\.environ|os\.putenv")
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if writes.search(p.read_text()))
    assert writers == ["environment.py"]


# What the launch core (nbaccel/launch/) must not import: the pillars above it. It reaches them
# through the RankLifecycle a request carries (what a rank forgets, how it joins) and through observers.
ABOVE_THE_LAUNCH_CORE = ("nbaccel.state", "nbaccel.partial_state", "nbaccel.process_state", "nbaccel.training",
                         "nbaccel.tracking", "nbaccel.widgets", "nbaccel.big_modeling")


def _imported_names(tree: ast.AST) -> list[str]:
    """Every module ``tree`` imports, at any depth: ``import a.b``, ``from a.b import c``, ``import_module("a.b")``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            # ``from nbaccel import state`` names the module it imports; ``from a.b import c`` imports a.b
            names += [f"nbaccel.{a.name}" for a in node.names] if node.module == "nbaccel" else [node.module or ""]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def _is_within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_launch_core_does_not_import_the_pillars_above_it():
    """launch/ asks machine facts (fp8 support included) of modules below both pillars; a rank's resets are
    registered."""
    root = Path(nbaccel.__file__).parent
    offenders = set()
    for path in sorted((root / "launch").rglob("*.py")):
        offenders |= {f"{path.relative_to(root)}: {name}" for name in _imported_names(ast.parse(path.read_text()))
                      if _is_within(name, ABOVE_THE_LAUNCH_CORE)}
    assert sorted(offenders) == []


def test_the_launch_core_check_sees_every_way_of_importing():
    source = ("import nbaccel.training.fp8\nfrom nbaccel import state\nimport importlib\n"
              "def f():\n    from nbaccel.tracking.history import last_run_history\n"
              "    importlib.import_module('nbaccel.widgets.status_panel')\n")
    found = [name for name in _imported_names(ast.parse(source)) if _is_within(name, ABOVE_THE_LAUNCH_CORE)]
    assert sorted(found) == ["nbaccel.state", "nbaccel.tracking.history", "nbaccel.training.fp8",
                             "nbaccel.widgets.status_panel"]


def test_only_the_package_root_has_a_module_getattr():
    """``nbaccel/__init__.py`` loads its public names lazily, on purpose; anywhere else a module ``__getattr__``
    hides a cycle."""
    root = Path(nbaccel.__file__).parent
    defining = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                      if any(isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
                             for node in ast.parse(p.read_text()).body))
    assert defining == ["__init__.py"]


def test_accelerates_state_names_are_plain_attributes_of_nbaccel_state():
    """``from accelerate.state import ...`` lines work with nbaccel.state, with nothing loaded on first use."""
    import nbaccel.state

    names = {"AcceleratorState", "GradientState", "PartialState", "ProcessState", "ThreadLocalSharedDict",
             "do_nothing", "get_distributed_backend", "get_torch_accelerator_backend", "is_initialized"}
    assert names <= set(vars(nbaccel.state))
    assert nbaccel.state.ProcessState is nbaccel.ProcessState and nbaccel.state.GradientState is nbaccel.GradientState
    assert nbaccel.state.__all__ == sorted(nbaccel.state.__all__)


def test_nothing_inside_nbaccel_imports_the_accelerate_facade():
    """``nbaccel.state`` gathers names for users; nbaccel's own modules import where each name lives (no cycle)."""
    edges = _nbaccel_imports()
    assert sorted(m for m, targets in edges.items() if "nbaccel.state" in targets) == []
