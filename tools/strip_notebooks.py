"""Strips outputs from notebooks so that git holds only their sources.

    python tools/strip_notebooks.py                  # strip every notebooks/*.ipynb in place
    python tools/strip_notebooks.py --check a.ipynb  # exit 1 naming each notebook not stripped

Stripping clears outputs and execution counts, drops per-cell metadata that a run writes
(timings, collapsed/scrolled state) and keeps only the kernelspec and language name of the
notebook's metadata, so a notebook run and saved in Jupyter diffs as its sources only.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from pathlib import Path

import nbformat

__all__ = ["main", "strip"]

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_KEPT_NOTEBOOK_METADATA = ("kernelspec",)


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` without outputs, execution counts or run-time metadata."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata = nbformat.NotebookNode()
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    language = nb.metadata.get("language_info", {}).get("name", "python")
    kept = {key: nb.metadata[key] for key in _KEPT_NOTEBOOK_METADATA if key in nb.metadata}
    nb.metadata = nbformat.from_dict({**kept, "language_info": {"name": language}})
    return nb


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--check", action="store_true", help="report, do not write")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(NOTEBOOKS.glob("*.ipynb"))
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        clean = strip(nb)
        if clean == nb:
            continue
        dirty.append(path)
        if not args.check:
            nbformat.write(clean, path)
    for path in dirty:
        verb = "not stripped (run tools/strip_notebooks.py)" if args.check else "stripped"
        print(f"{path}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    raise SystemExit(main())
