"""The README's tour runs as written: its Python blocks, in order, in an IPython shell."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import run

README = Path(__file__).parent.parent.parent / "README.md"


def test_readme_tour_cells_run_and_bring_back_state(ip, capfd):
    # Blocks fenced ```py are shown, not run: they need what a test here has not (a Ray cluster).
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert any(block.startswith("%%accel_launch") for block in blocks)
    for block in blocks:
        result = run(ip, block)
        assert result.error_in_exec is None and result.error_before_exec is None, block
    assert set(ip.user_ns["state"]) == {"weight", "bias"}
    out = capfd.readouterr().out
    assert "[rank0]: loss" in out and "[rank1]: loss" not in out  # accelerator.print: rank 0 only


def _long_options(parser) -> set[str]:
    return {next(o for o in action.option_strings if o.startswith("--")) for action in parser._actions
            if any(o.startswith("--") for o in action.option_strings) and action.dest != "help"}


def test_readme_lists_every_magic_option_and_cli_flag():
    import argparse

    from nbaccel.cli.main import build_parser
    from nbaccel.magics.magics import AccelMagics

    text = README.read_text()
    wanted = _long_options(AccelMagics.accel_launch.parser) | _long_options(AccelMagics.accel_config.parser)
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        assert f"nbaccel {name}" in text
        wanted |= _long_options(parser)
    missing = sorted(option for option in wanted if f"`{option}" not in text and f"{option} " not in text
                     and f"{option}`" not in text and f"{option}]" not in text)
    assert not missing, f"README.md does not mention {missing}"
