"""Lint and type check: ruff and mypy with the configuration in pyproject.toml, and every suppression says why.

Run by the README's test command like any test. mypy costs about 60 s on 2 cores with an empty cache and about
4 s with a warm one; its cache lives outside the repository, in the temp folder, so later runs are warm.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A suppression followed by its reason: `type: ignore[code]` then `  # why`, or `noqa: CODE` then ` - why`, each after
# a hash (not written out here: ruff would read this comment as a suppression).
_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<code>\[[^\]]*\])?(?P<rest>.*)$")
_NOQA = re.compile(r"#\s*noqa(?P<code>:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<rest>.*)$")


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name(name)
    if not exe.exists():
        pytest.fail(f"{name} is not installed beside {sys.executable}. Fix: pip install -e '.[test]'")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean() -> None:
    result = _tool("ruff", "check", "--no-cache", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_is_clean() -> None:
    cache = Path(tempfile.gettempdir()) / "nbaccel-mypy-cache"
    result = _tool("mypy", "--cache-dir", str(cache))
    assert result.returncode == 0, result.stdout + result.stderr


def bare_suppressions(paths: list[Path]) -> list[str]:
    """The `type: ignore` and `noqa` comments without an error code and a reason written beside them.

    Comments only, as mypy and ruff read them: the same words in a string (this file's samples) suppress nothing.
    """
    bare = []
    for path in paths:
        lines = path.read_text().splitlines()
        with path.open("rb") as source:
            comments = [t for t in tokenize.tokenize(source.readline) if t.type == tokenize.COMMENT]
        for comment in comments:
            for pattern in (_IGNORE, _NOQA):
                match = pattern.search(comment.string)
                if match and (not match["code"] or not re.search(r"\w", match["rest"])):
                    number = comment.start[0]
                    bare.append(f"{path}:{number}: {lines[number - 1].strip()}")
    return bare


# Where ruff looks (pyproject.toml's [tool.ruff]): the package, and the tests, scripts and benchmarks around it.
CHECKED = ("nbaccel", "tests", "scripts", "benchmarks", "examples")


def checked_files() -> list[Path]:
    """The repository's Python files that ruff checks."""
    return sorted([path for folder in CHECKED for path in (ROOT / folder).rglob("*.py")] + list(ROOT.glob("*.py")))


def test_every_suppression_says_why() -> None:
    bare = bare_suppressions(checked_files())
    assert not bare, ("suppressions without a code and a reason beside them (write `# type: ignore[code]  # why` "
                      "or `# noqa: CODE - why`):\n" + "\n".join(bare))


def test_a_bare_suppression_is_found(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    lines = ["x = 1  # type: ignore[assignment]  # reason", "y = 1  # type: ignore[assignment]",
             "z = 1  # type: ignore", "w = 1  # noqa: F401 - reason", "v = 1  # noqa: F401", "u = 1  # noqa"]
    sample.write_text("\n".join(lines) + "\n")
    found = bare_suppressions([sample])
    assert [entry.split(": ", 1)[1] for entry in found] == lines[1:3] + lines[4:]
