"""benchmarks/prefetch_pairs.py stays runnable: its --smoke run builds every pair and finds
that the prefetch changed no output bit."""

from __future__ import annotations

import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_smoke_run_checks_every_pair(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        module = importlib.import_module("prefetch_pairs")
        assert module.main(["--smoke"]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("prefetch_pairs", None)
    lines = capsys.readouterr().out.splitlines()
    checked = [line.split(":")[0] for line in lines if "changed no output bit" in line]
    assert checked == list(module.PAIRS), lines
