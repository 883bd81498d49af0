"""The benchmark scripts run their whole code path on a CPU (tiny shapes) and refuse what
cannot work here with a clear message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_gpu
import bench_overhead


def test_bench_gpu_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    bench_gpu.main(
        [
            "--device",
            "cpu",
            "--smoke",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--modes",
            "fp32",
            "torch.autocast bf16",
            "mixprec O2 bf16",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert "CPU smoke run" in text and "| gpt2-small | mixprec O2 bf16 |" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} >= {"fp32", "torch.autocast bf16", "mixprec O2 bf16"}
    assert all(r["median"] > 0 and r["error"] is None for r in rows)


def test_bench_gpu_refuses_full_shapes_on_cpu():
    with pytest.raises(SystemExit, match="pass --smoke"):
        bench_gpu.main(["--device", "cpu"])


def test_bench_overhead_names_the_machine_and_ratios(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_overhead.py",
            "--models",
            "launch-bound",
            "--phases",
            "forward",
            "--rounds",
            "1",
            "--modes",
            "torch-autocast",
            "O2",
            "--json",
            str(out),
        ],
    )
    bench_overhead.main()
    text = capsys.readouterr().out
    assert "threads" in text and "torch " in text and "| launch-bound | forward | O2 |" in text
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["vs_torch"] == 1.0 and rows[1]["calls"] > 100
