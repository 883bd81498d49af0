"""`mixprec bench`: argument errors, metrics, JSON schema and plots (tiny runs)."""

import json

import pytest
import torch
from torch import nn

from mixprec import cli
from mixprec.bench import report, runner
from mixprec.bench.workloads import BenchWorkload


def _tiny_workload(target=0.5, higher=True):
    def batches(data, batch, seed):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)

    def evaluate(forward, data):
        x, y = data
        return (forward(x).argmax(-1) == y).float().mean().item()

    g = torch.Generator().manual_seed(1)
    data = (torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    return BenchWorkload(
        name="tiny",
        description="tiny MLP",
        metric="accuracy",
        higher_is_better=higher,
        target=target,
        batch_size=8,
        steps=6,
        quick_steps=4,
        eval_every=2,
        prepare=lambda quick, seed: data,
        make_model=lambda d: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
        make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        batches=batches,
        loss=lambda out, y: nn.functional.cross_entropy(out.float(), y),
        evaluate=evaluate,
        samples_per_batch=lambda b: b,
        example_batch=lambda d, b: next(batches(d, b, 0)),
    )


@pytest.mark.parametrize(
    ("evals", "target", "higher", "want"),
    [
        ([(0, 0.0, 0.1), (5, 1.0, 0.4), (10, 2.0, 0.6), (15, 3.0, 0.9)], 0.5, True, 2.0),
        ([(0, 0.0, 0.1), (5, 1.0, 0.5)], 0.5, True, 1.0),  # reaching the target exactly counts
        ([(0, 0.0, 0.1), (5, 1.0, 0.4)], 0.5, True, None),  # never reached
        ([(0, 0.0, 4.6), (5, 1.5, 3.0), (10, 3.0, 2.1), (15, 4.5, 1.9)], 2.2, False, 3.0),
        ([(0, 0.0, 4.6), (5, 1.5, 3.0)], 2.2, False, None),
    ],
)
def test_time_to_target_on_synthetic_curves(evals, target, higher, want):
    assert runner.time_to_target(evals, target, higher) == want


def test_round_robin_run_measures_every_mode():
    wl = _tiny_workload()
    res = runner.run_workload(wl, list(runner.MODES), steps=6, memory=False)
    assert list(res) == list(runner.MODES)
    for r in res.values():
        assert len(r.step_times) == len(r.train_losses) == len(r.wall) == len(r.loss_scales) == 6
        assert r.wall == sorted(r.wall) and r.wall[-1] == pytest.approx(sum(r.step_times))
        assert [e[0] for e in r.evals] == [0, 2, 4, 6]
        assert 0.0 <= r.final_metric <= 1.0 and r.final_metric == r.evals[-1][2]
        assert r.throughput == pytest.approx(8 / r.median_step)
        assert r.skipped_steps == 0
    assert res["fp32"].speedup_vs_fp32 == 1.0 and res["torch-autocast"].speedup_vs_torch == 1.0
    # the fair race: compiled modes against torch.autocast + torch.compile, eager against eager
    compiled_ref = res["torch-autocast+compile"]
    assert compiled_ref.speedup_vs_torch == 1.0 and res["fp32+compile"].speedup_vs_fp32 == 1.0
    for mode in ("O2+compile", "graph+compile", "graph+compile-O3"):
        assert res[mode].speedup_vs_torch == compiled_ref.median_step / res[mode].median_step
    assert res["O2"].speedup_vs_torch == res["torch-autocast"].median_step / res["O2"].median_step


def test_time_budget_stops_each_mode():
    wl = _tiny_workload()
    res = runner.run_workload(wl, ["fp32", "O2"], steps=1000, time_budget=1e-9, memory=False)
    assert all(len(r.step_times) == 1 for r in res.values())


def test_a_shared_budget_ends_every_mode_at_the_same_round(monkeypatch):
    step = runner.Trainer.step

    def slow_o2(self):  # O2's steps count 1 s more on its clock
        dt, loss = step(self)
        return dt + (1.0 if self.mode == "O2" else 0.0), loss

    monkeypatch.setattr(runner.Trainer, "step", slow_o2)
    wl = _tiny_workload()
    kw = {"steps": 20, "time_budget": 2.5, "memory": False}
    alone = runner.run_workload(wl, ["fp32", "O2"], **kw)
    assert len(alone["fp32"].step_times) == 20 and len(alone["O2"].step_times) == 3
    together = runner.run_workload(wl, ["fp32", "O2"], together=True, **kw)
    assert [len(r.step_times) for r in together.values()] == [3, 3]
    assert [e[0] for e in together["fp32"].evals] == [0, 2, 3]  # evaluated where it stopped
    # min_steps: a budget never ends a mode before it has that many steps
    short = runner.run_workload(
        wl, ["fp32", "O2"], steps=20, time_budget=1e-9, min_steps=4, memory=False
    )
    assert [len(r.step_times) for r in short.values()] == [4, 4]


def test_quartiles_and_round_ratios():
    assert runner.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    assert runner.quartiles([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="no step was timed"):
        runner.quartiles([])
    # the first (warm-up) round is dropped; above 1 means the second list is faster
    assert runner.round_ratios([9.0, 2.0, 3.0], [1.0, 1.0, 2.0]) == [2.0, 1.5]
    assert runner.round_ratios([2.0], [1.0]) == [2.0]


def test_json_document_follows_the_schema(tmp_path):
    wl = _tiny_workload()
    modes = runner.run_workload(wl, ["fp32", "O2"], steps=2, memory=False)
    doc = report.to_json(
        report.meta("mixprec bench tiny", torch.bfloat16, 0, True), {"tiny": (wl, modes)}
    )
    report.write_json(doc, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["schema"] == report.SCHEMA
    assert {"date", "hardware", "torch", "python", "command", "dtype", "seed", "quick"} <= set(
        back["meta"]
    )
    w = back["workloads"]["tiny"]
    assert w["metric"] == "accuracy" and w["target"] == 0.5 and set(w["modes"]) == {"fp32", "O2"}
    fields = {
        "mode",
        "step_times",
        "train_losses",
        "wall",
        "evals",
        "loss_scales",
        "skipped_steps",
        "median_step",
        "throughput",
        "speedup_vs_fp32",
        "speedup_vs_torch",
        "final_metric",
        "time_to_target",
        "peak_bytes",
        "max_batch",
    }
    assert set(w["modes"]["O2"]) == fields
    assert len(report.rows(wl, modes)) == 2 and report.markdown(wl, modes).count("\n") == 3
    report.write_json({"schema": "again"}, tmp_path / "r.json")  # replaced whole, no leftovers
    assert json.loads((tmp_path / "r.json").read_text()) == {"schema": "again"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_plots_are_written(tmp_path):
    wl = _tiny_workload()
    modes = runner.run_workload(wl, ["fp32", "O1"], steps=2, memory=False)
    paths = report.write_plots(wl, modes, tmp_path)
    assert [p.name for p in paths] == [
        "tiny_loss_vs_time.png",
        "tiny_loss_scale.png",
        "tiny_step_time.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_batch_search_respects_the_budget():
    wl = _tiny_workload()
    data = wl.prepare(True, 0)
    assert runner.max_batch(wl, data, "fp32", torch.bfloat16, 2**40, start=8, limit=3) == 32
    assert runner.max_batch(wl, data, "fp32", torch.bfloat16, -1, start=8) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "imagenet"], "unknown workload(s) ['imagenet']"),
        (["bench", "--steps", "0"], "--steps must be a positive integer"),
        (["bench", "--batch-size", "-2"], "--batch-size must be a positive integer"),
        (["bench", "--time-budget", "0"], "--time-budget must be positive"),
        (["bench", "--max-batch", "-5"], "--max-batch must be positive"),
        (["bench", "--modes", "O9"], "invalid choice"),
        (["bench", "--dtype", "fp8"], "invalid choice"),
    ],
)
def test_bench_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("workload", "extra"),
    [("seed-mlp", []), ("mnist1d-cnn", []), ("char-gpt", ["--batch-size", "2"])],
)
def test_bench_command_quick_tiny_run(workload, extra, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "bench",
                workload,
                "--quick",
                "--steps",
                "3",
                "--modes",
                "fp32",
                "O2",
                "--no-progress",
                "--no-memory",
                "--out",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    modes = doc["workloads"][workload]["modes"]
    assert set(modes) == {"fp32", "O2"} and all(len(m["step_times"]) == 3 for m in modes.values())
    assert doc["meta"]["quick"] is True and "--quick" in doc["meta"]["command"]
    assert (out / f"{workload}_loss_vs_time.png").exists()
    assert workload in capsys.readouterr().out


def test_bench_on_a_larger_generated_mnist1d_set(tmp_path):
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "bench",
                "mnist1d-cnn",
                "--quick",
                "--steps",
                "2",
                "--modes",
                "fp32",
                "--mnist1d-samples",
                "1500",
                "--no-progress",
                "--no-memory",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    assert "--mnist1d-samples 1500" in doc["meta"]["command"]
    from mixprec.bench.workloads import make_large_mnist1d

    hits = make_large_mnist1d.cache_info().hits
    assert len(make_large_mnist1d(1500)["x"]) == 1200  # the set the run used: 80/20 of 1500
    assert make_large_mnist1d.cache_info().hits == hits + 1


def test_bench_rejects_bad_mnist1d_samples(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--mnist1d-samples", "0"])
    assert "--mnist1d-samples must be a positive integer" in capsys.readouterr().err


def _mode(name, times):
    return runner.ModeResult(name, step_times=list(times), evals=[(0, 0.0, 0.5)])


def _ratio_cell(cell):
    """'2.00x faster' -> 2.0, '1.25x slower' -> 0.8, 'same speed' -> 1.0 (time ratio base/mode)."""
    if cell == "same speed":
        return 1.0
    value, word = cell.split()
    return float(value.rstrip("x")) ** (1 if word == "faster" else -1)


def test_table_ratios_are_the_ratios_of_the_numbers_shown():
    # per-round ratios (median 2.07) that differ from the ratio of the medians (2.5 / 1.45 =
    # 1.72): the table must show numbers a reader can check against each other
    wl = _tiny_workload()
    fp32 = [0.9, 1.0, 2.0, 3.0, 4.0]
    modes = {
        "fp32": _mode("fp32", fp32),
        "torch-autocast": _mode("torch-autocast", [t / 1.1 for t in fp32]),
        "O2": _mode("O2", [0.9, 0.5, 1.5, 1.4, 1.6]),
    }
    runner._summarize(wl, modes, batch=8)
    assert modes["O2"].speedup_vs_fp32 == pytest.approx(2.5 / 1.45)
    assert report.HEADERS[1:5] == ["median step", "per s", "vs fp32", "vs torch"]
    rows = {row[0]: row for row in report.rows(wl, modes)}
    step = {m: float(row[1].removesuffix("ms")) for m, row in rows.items()}
    for m, row in rows.items():
        rate = float(row[2].rstrip("k")) * (1e3 if row[2].endswith("k") else 1)
        assert rate == pytest.approx(8 / (step[m] / 1e3), rel=0.015)  # per s = batch / step
        for base, cell in (("fp32", row[3]), ("torch-autocast", row[4])):
            assert _ratio_cell(cell) == pytest.approx(step[base] / step[m], rel=0.015), (m, cell)
    # and the JSON carries the ratios the table shows
    doc = report.to_json(report.meta("t", torch.bfloat16, 0, True), {"tiny": (wl, modes)})
    o2 = doc["workloads"]["tiny"]["modes"]["O2"]
    assert o2["speedup_vs_fp32"] == pytest.approx(2.5 / 1.45)
    assert doc["schema"] == "mixprec.bench/2"


def test_bench_saves_json_after_each_workload_and_ctrl_c_stops_cleanly(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import mixprec

    root = os.path.dirname(os.path.dirname(mixprec.__file__))
    path = tmp_path / "results.json"
    # mnist1d-cnn finishes in seconds; char-gpt would then train for a minute
    cmd = [sys.executable, "-m", "mixprec", "bench", "mnist1d-cnn", "char-gpt", "--quick"]
    cmd += ["--modes", "fp32", "--steps", "300", "--batch-size", "2", "--time-budget", "60"]
    cmd += ["--no-memory", "--no-plots", "--no-progress", "--out", str(tmp_path)]
    # a terminal delivers Ctrl-C to a child that handles it; a non-interactive shell may have
    # started these tests with SIGINT ignored, which a child would inherit
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [*cmd, "--json", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": root},
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), "no JSON after the first workload"
        assert proc.poll() is None, "the run ended before it could be interrupted"
        saved = json.loads(path.read_text())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(saved["workloads"]) == ["mnist1d-cnn"]
    assert len(saved["workloads"]["mnist1d-cnn"]["modes"]["fp32"]["step_times"]) == 300
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "interrupted" in err and str(path) in err and "mnist1d-cnn" in err
    assert json.loads(path.read_text()) == saved  # what finished is still there
