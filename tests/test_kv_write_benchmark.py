"""benchmarks/kv_write.py stays runnable: its --smoke rows write every layer's keys where
they go, with each writer."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_smoke_rows_write_every_key_where_it_goes(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "kv_write", ROOT / "benchmarks" / "kv_write.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main(["--smoke"]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| B=")]
    assert len(rows) == 2 * len(module.WRITERS), rows
    assert all(" | ok | " in row for row in rows), rows
