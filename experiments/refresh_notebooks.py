"""Re-executes the notebooks in ``notebooks/`` and saves them WITH their outputs (plots show on the repository
page). Run from the repository root after changing a notebook or what it shows::

    python -m experiments.refresh_notebooks                 # every notebook
    python -m experiments.refresh_notebooks 02_klms         # one (name with or without .ipynb)

Each notebook runs top to bottom in a fresh ``python3`` kernel whose working directory is ``notebooks/`` and
which imports this checkout's ``sidejax`` (the repository root goes first on ``PYTHONPATH``). Volatile
metadata (execution timestamps) is not recorded, so a refresh changes only what the cells print and draw.

:func:`execute_notebook` is also what ``tests/test_notebooks.py`` runs, with smaller sizes: a notebook's
first cell tagged ``parameters`` holds its sizes, and ``overrides`` is inserted as a new cell right after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["NOTEBOOK_DIR", "execute_notebook", "notebook_errors", "main"]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"


def execute_notebook(path: Path, overrides: str | None = None, timeout: int = 900):
    """Runs the notebook at ``path`` and returns it (an ``nbformat`` node) with its outputs.

    Args:
      path: the ``.ipynb`` file.
      overrides: code run right after the cell tagged ``parameters`` (e.g. smaller sizes for a test).
      timeout: seconds allowed per cell.

    Raises:
      ValueError: ``overrides`` given but the notebook has no cell tagged ``parameters``.
      nbclient.exceptions.CellExecutionError: a cell raised (the message shows the cell and traceback).
      RuntimeError: the execution failed otherwise (the kernel died, a timeout): the message names the
        notebook and the cell that was running.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    injected = None
    if overrides:
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        if not tagged:
            raise ValueError(f"{path}: no cell tagged 'parameters' to override")
        injected = nbformat.v4.new_code_cell(overrides)
        injected.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(tagged[0] + 1, injected)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env_path if env_path else "")
    running = {}

    def started(cell, cell_index):
        running.update(index=cell_index, source=cell.source)

    try:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
            on_cell_start=started,
        ).execute()
    except CellExecutionError:
        raise  # its message shows the cell and the traceback
    except Exception as exc:
        # Anything else (a kernel that died, nbclient's internal asserts once its kernel client is gone)
        # says nothing about where it happened: name the notebook and the cell that was running.
        where = "before the first cell"
        if running:
            where = f"cell {running['index']}: {running['source'][:200]!r}"
        raise RuntimeError(f"{path.name}: {type(exc).__name__} while executing {where}: {exc}") from exc
    finally:
        if env_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env_path
    return nb


def notebook_errors(nb) -> list:
    """The error outputs of a notebook's code cells."""
    return [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(prog="python -m experiments.refresh_notebooks", description=__doc__)
    parser.add_argument("names", nargs="*", help="notebooks to refresh (default: all in notebooks/)")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if args.names:
        wanted = {n.removesuffix(".ipynb") for n in args.names}
        unknown = wanted - {p.stem for p in paths}
        if unknown:
            print(
                f"error: no notebook {sorted(unknown)}; notebooks: {[p.stem for p in paths]}", file=sys.stderr
            )
            return 2
        paths = [p for p in paths if p.stem in wanted]
    for path in paths:
        t = time.perf_counter()
        nb = execute_notebook(path)
        nbformat.write(nb, path)
        print(f"{path.relative_to(ROOT)}: executed in {time.perf_counter() - t:.0f} s, outputs saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
