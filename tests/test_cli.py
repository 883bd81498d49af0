"""The console entry point and the benchmark harness run end to end (tiny sizes)."""

import pytest
import torch
from torch import nn

from mixprec import benchmarking, cli, demo


def test_demo_runs_and_reports_every_mode(capsys):
    assert cli.main(["demo", "--steps", "3", "--batch", "64", "--levels", "O0", "O2",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "fp32" in out and "O2" in out and "faster than fp32" in out


def test_demo_results_are_real_measurements():
    data = demo.load_mnist1d()
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
        "tiny", "tiny MLP",
        lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)),
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        lambda g: (torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)))
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


def test_build_step_rejects_unknown_mode():
    with pytest.raises(ValueError, match="Unknown mode 'O9'"):
        benchmarking.build_step(benchmarking.WORKLOADS["seed-mlp"], "O9")
