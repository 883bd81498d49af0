"""The console entry point and the benchmark harness run end to end (tiny sizes)."""

import re

import pytest
import torch
from torch import nn

from mixprec import cli
from mixprec.bench import steps as benchmarking
from mixprec.bench import workloads
from mixprec.cli import demo


def test_demo_runs_and_reports_every_mode(capsys):
    assert (
        cli.main(["demo", "--steps", "3", "--batch", "64", "--levels", "O0", "O2", "--no-progress"])
        == 0
    )
    out = capsys.readouterr().out
    assert "fp32" in out and "O2" in out
    assert "faster than fp32 here" in out or "16-bit is not faster here" in out


def _no_bf16_cpu():
    from mixprec.core import hardware

    flags = frozenset({"avx2", "fma"})  # an AVX2-only EPYC: bf16 emulated
    return hardware.HardwareReport(
        "cpu", "AMD EPYC (no AVX512)", tuple(sorted(flags)), hardware._cpu_support(flags)
    )


def test_demo_on_a_cpu_without_fast_16bit_is_bounded_and_honest(monkeypatch, capsys):
    import mixprec
    from mixprec.core import hardware

    report = _no_bf16_cpu()
    assert report.best_dtype == torch.float32
    monkeypatch.setattr(mixprec, "check", lambda *a, **k: report)
    monkeypatch.setattr(hardware, "check", lambda *a, **k: report)
    assert (
        cli.main(
            [
                "demo",
                "--steps",
                "12",
                "--batch",
                "64",
                "--levels",
                "O0",
                "O2",
                "--budget",
                "0.001",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "is not fast on this CPU" in out and "at most 0 s each" in out and "1024 wide" in out
    cells = [
        [c.strip() for c in re.split(r"│|\|| {2,}", line) if c.strip()] for line in out.splitlines()
    ]  # a rich table, or the plain two-space one
    rows = {c[0]: c for c in cells if c and c[0] in ("fp32", "O2 bf16")}
    assert rows["fp32"][1] == "12" and rows["O2 bf16"][1] == "3"  # the 16-bit level stopped
    last = out.strip().splitlines()[-1]
    assert "faster than fp32" in last or "16-bit is not faster here" in last


def test_verdict_never_calls_a_slowdown_a_speed_up():
    report = _no_bf16_cpu()
    base = demo.DemoResult("fp32", 0.010, 0.8, 2.3, 0.5, 400 * 2**20, 0, 60)
    slow = demo.DemoResult("O2 bf16", 0.700, 0.79, 2.3, 0.6, 240 * 2**20, 0, 3)
    text = demo.verdict([base, slow], report, torch.bfloat16)
    assert text.startswith("16-bit is not faster here (")
    assert "70.0x the fp32 step time" in text and "40% less peak memory" in text
    assert "faster than fp32" not in text.split(". On a GPU")[0]
    fast = demo.DemoResult("O2 bf16", 0.005, 0.8, 2.3, 0.5, 240 * 2**20, 0, 60)
    assert demo.verdict([base, fast], report, torch.bfloat16).startswith(
        "O2 bf16 steps are 2.00x faster than fp32 here"
    )
    assert demo.speed_words(0.03) == "33.33x slower" and demo.speed_words(1.8) == "1.80x faster"
    assert demo.format_results([base, slow])[1][3] == "70.00x slower"


def test_demo_results_are_real_measurements():
    data = workloads.load_mnist1d()
    assert data["x"].shape == (4000, 40) and data["x_test"].shape == (1000, 40)
    r = demo.train_one(data, "O2", torch.bfloat16, steps=4, batch=64)
    assert 0.0 <= r.accuracy <= 1.0 and r.median_step > 0 and r.skipped_steps == 0
    assert torch.isfinite(torch.tensor([r.first_loss, r.final_loss])).all()


def test_demo_rejects_too_few_steps(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--steps", "1"])
    assert "--steps must be at least 3" in capsys.readouterr().err


def test_check_prints_the_report(capsys):
    assert cli.main(["check"]) == 0
    assert "bfloat16" in capsys.readouterr().out


def test_benchmark_harness_times_every_mode(monkeypatch):
    tiny = benchmarking.step_workload(
        "tiny",
        "tiny MLP",
        lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)),
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        lambda g: (torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)),
    )
    monkeypatch.setitem(benchmarking.WORKLOADS, "tiny", tiny)
    # the torch.compile modes are covered by tests/test_convert.py (compiling every one of them
    # here would only time inductor)
    modes = [m for m in benchmarking.MODES if "compile" not in m]
    results = benchmarking.run(["tiny"], modes, rounds=2, warmup=1, log=lambda s: None)
    assert [r.mode for r in results] == modes
    assert all(len(r.times) == 2 and r.vs_fp32 > 0 and r.final_loss > 0 for r in results)
    fp32 = next(r for r in results if r.mode == "fp32")
    assert fp32.vs_fp32 == 1.0
    table = benchmarking.format_table(results)
    assert table.count("\n") == len(results) + 1
    # the ratio columns are the ratios of the median steps the table shows next to them
    for r, line in zip(results, table.splitlines()[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert r.vs_fp32 == pytest.approx(fp32.median / r.median)
        assert float(cells[3].rstrip("x")) == pytest.approx(fp32.median / r.median, abs=0.006)


def test_build_step_rejects_unknown_mode():
    with pytest.raises(ValueError, match="Unknown mode 'O9'"):
        benchmarking.build_step(benchmarking.WORKLOADS["seed-mlp"], "O9")


def test_python_dash_m_mixprec_is_the_mixprec_command(tmp_path):
    import os
    import subprocess
    import sys

    import mixprec

    root = os.path.dirname(os.path.dirname(mixprec.__file__))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: mixprec ") and "demo" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0 and "best dtype" in done.stdout
