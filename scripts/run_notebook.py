"""Execute a notebook headless in a real Jupyter kernel and print what its cells printed.

Usage: ``python scripts/run_notebook.py NOTEBOOK [--timeout SECONDS]``. Exits non-zero on a cell
error. The notebook file is not modified.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _print_outputs(cell: dict) -> None:
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream":
            target = sys.stdout if output.get("name") == "stdout" else sys.stderr
            target.write(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text = output.get("data", {}).get("text/plain")
            if text:
                print(text)
        elif kind == "error":
            print("\n".join(output.get("traceback", [])), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the notebook; return 0 when every cell succeeded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    os.environ.setdefault("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(args.notebook.parent)}})
    start = time.monotonic()
    try:
        client.execute()
    except CellExecutionError:
        failed = True
    else:
        failed = False
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.get("outputs"):
            print(f"--- cell {index} ---")
            _print_outputs(cell)
    print(f"--- {args.notebook.name}: {'FAILED' if failed else 'ok'} in {time.monotonic() - start:.1f}s ---")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
