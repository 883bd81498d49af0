"""The console entry point and the benchmark harness run end to end (tiny sizes)."""

import re
import statistics

import pytest
import torch
from torch import nn

from mixprec import cli
from mixprec.bench import runner, workloads
from mixprec.bench import steps as benchmarking
from mixprec.cli import demo


def test_demo_runs_and_reports_every_mode(capsys):
    argv = ["demo", "--steps", "3", "--batch", "8", "--width", "32", "--levels", "O0", "O2"]
    threads = torch.get_num_threads()
    assert cli.main([*argv, "--no-progress", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads  # main() gives the process its threads back
    out = capsys.readouterr().out
    assert "fp32" in out and "O2" in out
    verdicts = ("faster than fp32 here", "16-bit is not faster here", "no mixed mode was faster")
    assert any(v in out for v in verdicts)  # a 32-wide MLP may be too small to gain on any CPU


def _cpu(name, flags):
    from mixprec._core import hardware

    flags = frozenset(flags)
    return hardware.HardwareReport("cpu", name, tuple(sorted(flags)), hardware._cpu_support(flags))


def _no_bf16_cpu():
    return _cpu("AMD EPYC (no AVX512)", {"avx2", "fma"})  # an AVX2-only EPYC: bf16 emulated


def _fast_bf16_cpu():
    return _cpu("Intel Xeon (AMX)", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def test_demo_on_a_cpu_without_fast_16bit_is_bounded_and_honest(monkeypatch, capsys):
    import mixprec
    from mixprec._core import hardware

    report = _no_bf16_cpu()
    assert report.best_dtype == torch.float32
    monkeypatch.setattr(mixprec, "check", lambda *a, **k: report)
    monkeypatch.setattr(hardware, "check", lambda *a, **k: report)
    argv = ["demo", "--steps", "12", "--batch", "8", "--width", "32", "--levels", "O0", "O2"]
    assert cli.main([*argv, "--budget", "0.001", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "is not fast on this CPU" in out and "32 wide" in out
    assert "once a 16-bit level has trained 0.001 s" in out
    rows = _rows(out, ("fp32", "O2 bf16"))
    # the budget ends every mode at the same round, after the 3 steps a median needs
    assert rows["fp32"][1] == "3" and rows["O2 bf16"][1] == "3"
    # tiny tensors can go either way; the wording for each case is tested on the verdict
    assert "\nSpeed: 16-bit is not faster here (" in out or "\nSpeed: O2 bf16 is the fastest" in out


def test_demo_results_are_real_measurements():
    data = workloads.load_mnist1d()
    assert data["x"].shape == (4000, 40) and data["x_test"].shape == (1000, 40)
    results = demo.run_demo(steps=4, levels=("O0", "O2"), batch=8, width=32, progress=False)
    for r in results.values():
        assert 0.0 <= r.final_metric <= 1.0 and r.median_step > 0 and r.skipped_steps == 0
        assert len(r.step_times) == 4 and torch.isfinite(torch.tensor(r.train_losses)).all()


def test_threads_drop_to_the_cores_other_jobs_leave_free(monkeypatch, capsys):
    import os

    from mixprec.cli import commands

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 4.0, 3.0))  # two other jobs' threads
    assert commands._choose_threads(None) == 1
    assert (
        "busy (load average 5.0 on 2 cores), so torch runs on 1 of its 2" in capsys.readouterr().out
    )
    assert commands._choose_threads(2) == 2  # --threads wins, silently
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.3, 0.3))  # an idle host
    assert commands._choose_threads(None) == 2 and capsys.readouterr().out == ""


def test_demo_rejects_bad_levels(capsys):
    for levels in (["O1", "O2"], ["O0", "O2", "O2"]):
        with pytest.raises(SystemExit):
            cli.main(["demo", "--levels", *levels])
        assert "--levels must start with O0" in capsys.readouterr().err


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
    # the torch.compile modes are covered by tests/graph/test_convert.py (compiling every one of
    # them here would only time inductor)
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


# ----------------------------------------------------------------- the demo, interleaved


def _rows(out: str, names: tuple[str, ...]) -> dict[str, list[str]]:
    """The table rows of a rich table or the plain two-space one, keyed by mode."""
    cells = [
        [c.strip() for c in re.split(r"│|\|| {2,}", line) if c.strip()] for line in out.splitlines()
    ]
    return {c[0]: c for c in cells if c and c[0] in names}


def _ms(cell: str) -> float:
    return float(cell.split()[0])


class _Recorder:
    """A progress display that records which mode stepped, in order."""

    def __init__(self):
        self.order: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def add(self, name, total):
        return name

    def advance(self, task):
        self.order.append(task)


def test_demo_interleaves_its_modes_round_by_round(monkeypatch):
    import mixprec

    # a fast-bf16 host's rows on any host (a slow one adds storage-only: test_demo_storage.py)
    monkeypatch.setattr(mixprec, "check", lambda *a, **k: _fast_bf16_cpu())
    recorder = _Recorder()
    monkeypatch.setattr(demo, "make_progress", lambda enabled=True: recorder)
    results = demo.run_demo(
        steps=4, levels=("O0", "O1", "O2"), batch=8, width=32, dtype=torch.bfloat16
    )
    names = list(results)
    assert names == ["fp32", "O1 bf16", "O2 bf16"]
    # every round runs every mode once, in turn: fp32, O1, O2, fp32, O1, O2, ...
    assert recorder.order == names * 4
    assert all(len(r.step_times) == 4 for r in results.values())


def test_demo_table_shows_medians_and_spread_and_ratios_from_them(capsys):
    argv = ["demo", "--steps", "5", "--batch", "8", "--width", "32", "--no-progress"]
    assert cli.main([*argv, "--levels", "O0", "O1", "O2"]) == 0
    out = capsys.readouterr().out
    assert "median step" in out and "middle half" in out
    rows = _rows(out, ("fp32", "O1 bf16", "O2 bf16", "O1 fp16", "O2 fp16"))
    base = _ms(rows["fp32"][2])
    assert rows["fp32"][4] == "baseline"
    for name, row in rows.items():
        assert row[1] == "5"  # every mode ran the same rounds
        low, high = (float(v) for v in row[3].split()[0].split("–"))
        assert low <= _ms(row[2]) <= high  # the median lies in the middle half shown
        if name == "fp32":
            continue
        words = row[4].split()
        ratio = float(words[0].rstrip("x"))
        shown = base / _ms(row[2]) if words[1] == "faster" else _ms(row[2]) / base
        # the ratio is the ratio of the medians shown (up to their 3 significant digits)
        assert ratio == pytest.approx(shown, rel=0.015), (row, base)


_JITTER = (1.3, 0.9, 1.0, 1.1, 0.95, 1.05, 1.0, 0.92, 1.08)


def _result(mode, step, peak, acc=0.5, jitter=_JITTER):
    """A ModeResult whose steps are ``step`` seconds times ``jitter`` (the first is warm-up)."""
    times = [step * f for f in jitter]
    r = runner.ModeResult(mode, step_times=times, train_losses=[2.3] * len(times))
    r.median_step = statistics.median(times[1:])
    r.final_metric, r.peak_bytes = acc, peak
    return r


def test_verdict_makes_one_claim_per_mode_on_fast_and_slow_hardware():
    # O1 is the fastest, O2 the leanest: each claim must carry its own mode's name and numbers
    results = {
        "fp32": _result("fp32", 0.300, 400 * 2**20),
        "O1 bf16": _result("O1", 0.150, 380 * 2**20),
        "O2 bf16": _result("O2", 0.200, 240 * 2**20),
    }
    for hw, prefix in ((_fast_bf16_cpu(), "Speed: O1 bf16"), (_no_bf16_cpu(), "Speed: 16-bit")):
        text = demo.verdict(results, hw, torch.bfloat16)
        speed = next(s for s in text.split("\n") if s.startswith("Speed:"))
        memory = next(s for s in text.split("\n") if s.startswith("Memory:"))
        assert speed.startswith(prefix) if hw.is_fast(torch.bfloat16) else True
        assert "O1 bf16" in speed and "O2 bf16" not in speed and "2.00x faster" in speed
        assert "O2 bf16" in memory and "O1 bf16" not in memory
        assert "40% less peak memory" in memory and "240 MB vs 400 MB" in memory
    slow = {
        "fp32": _result("fp32", 0.010, 400 * 2**20),
        "O1 bf16": _result("O1", 0.700, 380 * 2**20),
        "O2 bf16": _result("O2", 0.800, 240 * 2**20),
    }
    text = demo.verdict(slow, _no_bf16_cpu(), torch.bfloat16)
    speed = next(s for s in text.split("\n") if s.startswith("Speed:"))
    assert speed.startswith("Speed: 16-bit is not faster here (")
    assert (
        "O1 bf16, the fastest 16-bit mode, takes 70.0x fp32's median step" in speed
        and "O2 bf16" not in speed
    )
    assert "faster than fp32" not in text.split("On a GPU")[0]


def test_verdict_says_when_the_runner_up_is_within_the_spread():
    results = {
        "fp32": _result("fp32", 0.300, None),
        "O1 bf16": _result("O1", 0.160, None),
        # other jitter than fp32's: per-round ratios 1.83-2.11x in the middle half
        "O2 bf16": _result(
            "O2", 0.155, None, jitter=(1.3, 1.1, 0.9, 1.05, 1.0, 0.92, 1.08, 0.95, 1)
        ),
    }
    text = demo.verdict(results, _fast_bf16_cpu(), torch.bfloat16)
    lines = text.split("\n")
    assert lines[0].startswith("Speed: O2 bf16 is the fastest mode")
    assert any(s.startswith("O1 bf16 (1.88x faster) is within that spread") for s in lines)
    assert any(s.startswith("Memory: not measured") for s in lines)


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
    bare = subprocess.run(
        [sys.executable, "-m", "mixprec"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert bare.returncode == 0 and bare.stdout == done.stdout, bare.stderr  # the help
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0 and "best dtype" in done.stdout


def test_version_prints_the_version_and_a_bare_command_prints_the_help(capsys):
    import mixprec

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"mixprec {mixprec.__version__} (torch {torch.__version__})\n"
    assert cli.main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: mixprec ") and "{demo,bench,check" in out and "--version" in out
    assert err == "" and "required" not in out
