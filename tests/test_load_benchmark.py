"""benchmarks/load.py stays runnable: its --smoke run writes a tiny checkpoint, loads it back
in every row and reports a rate."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_smoke_rows_all_load_and_report_a_rate(tmp_path):
    spec = importlib.util.spec_from_file_location("load_bench", ROOT / "benchmarks" / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path / "ckpt"
    assert module.main(["--smoke", "--dir", str(folder), "--out", str(tmp_path)]) == 0
    assert not folder.exists(), "the written checkpoint is removed unless --keep"
    text = (tmp_path / "RESULTS_load_smoke.md").read_text()
    rows = re.findall(r"^\| (first|cold|warm)[^|]* \| ([\d.e+-]+) GB \| ([\d.]+) s \|", text, re.M)
    assert [name for name, _, _ in rows] == ["first", "cold", "cold", "warm", "warm"], text
    assert all(float(size) > 0 and float(seconds) > 0 for _, size, seconds in rows), text
