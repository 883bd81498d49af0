"""The demo where 16-bit compute is slow: a storage-only row, raced in the same rounds, and a
verdict that picks from the run's own numbers; where it is fast, the rows stay the levels."""

import math
import re
import statistics

import pytest
import torch

import mixprec
from mixprec import cli
from mixprec._core import hardware
from mixprec.bench import runner, workloads
from mixprec.cli import demo
from tests.cli.test_cli import _Recorder

ROW = "storage-only bf16"


def _cpu(name, flags):
    flags = frozenset(flags)
    return hardware.HardwareReport("cpu", name, tuple(sorted(flags)), hardware._cpu_support(flags))


SLOW = _cpu("AMD EPYC (AVX2 only)", {"avx2", "fma"})  # bf16 matmuls emulated
FAST = _cpu("Intel Xeon (AMX)", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def _report_as(monkeypatch, report):
    """The capability every caller reads, as ``mixprec.check`` reports it."""
    monkeypatch.setattr(mixprec, "check", lambda *a, **k: report)
    monkeypatch.setattr(hardware, "check", lambda *a, **k: report)


def _rows(out):
    cells = [
        [c.strip() for c in re.split(r"│|\|| {2,}", line) if c.strip()] for line in out.splitlines()
    ]
    return {c[0]: c for c in cells if c and c[0] in ("fp32", "O1 bf16", "O2 bf16", ROW)}


def test_a_slow_host_gets_a_storage_only_row_and_a_pick(monkeypatch, capsys):
    _report_as(monkeypatch, SLOW)
    argv = ["demo", "--steps", "4", "--batch", "8", "--width", "32", "--levels", "O0", "O2"]
    assert cli.main([*argv, "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "Recipe('lean', torch.bfloat16, compute='fp32')" in out.split("\n")[1]  # the intro
    rows = _rows(out)
    assert list(rows) == ["fp32", "O2 bf16", ROW]
    row = rows[ROW]
    assert row[1] == "4"  # the same rounds as every other mode
    assert math.isfinite(float(row[2].split()[0])) and float(row[2].split()[0]) > 0
    assert re.fullmatch(r"\d+\.\d\dx (faster|slower)|about the same", row[4]), row[4]
    assert re.fullmatch(r"\d+ MB", row[7]), row[7]  # measured like the others
    claim = next(s for s in out.split("\n") if s.startswith("Storage-only: "))
    assert "by its table 4.0 B/param of training state with AdamW against fp32's 16.0" in claim
    ratio = float(re.search(r"takes (\S+)x fp32's median step", claim).group(1))
    assert math.isfinite(ratio) and ratio > 0
    pick = next(s for s in out.split("\n") if s.startswith("Pick: "))
    assert any(pick.startswith(f"Pick: {n}") for n in ("fp32", "O2 bf16", ROW)), pick
    speed = next(s for s in out.split("\n") if s.startswith("Speed: "))
    assert ROW not in speed  # the speed claim is the 16-bit-compute levels'


@pytest.mark.parametrize("report", [SLOW, FAST], ids=["slow", "fast"])
def test_the_storage_only_row_takes_its_turn_in_every_round(monkeypatch, report):
    _report_as(monkeypatch, report)
    recorder = _Recorder()
    monkeypatch.setattr(demo, "make_progress", lambda enabled=True: recorder)
    results = demo.run_demo(steps=3, levels=("O0", "O2"), batch=8, width=32)
    names = ["fp32", "O2 bf16"] + ([ROW] if report is SLOW else [])
    assert list(results) == names and recorder.order == names * 3
    if report is SLOW:
        r = results[ROW]
        assert r.mode == demo.STORAGE and r.peak_bytes is not None and r.median_step > 0


def test_a_fast_host_keeps_its_rows(monkeypatch, capsys):
    _report_as(monkeypatch, FAST)
    argv = ["demo", "--steps", "3", "--batch", "8", "--width", "32", "--levels", "O0", "O2"]
    assert cli.main([*argv, "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert list(_rows(out)) == ["fp32", "O2 bf16"]
    assert "storage-only" not in out and "Pick:" not in out


def test_the_storage_only_mode_stores_16_bit_and_computes_in_fp32():
    wl = demo.workload(32, 8)
    t = runner.Trainer(wl, workloads.load_mnist1d(), "storage-only", torch.bfloat16, 8, 0)
    recipe = t.opt.recipe
    assert (recipe.name, recipe.dtype, recipe.compute) == ("lean", torch.bfloat16, "fp32")
    assert all(p.dtype == torch.bfloat16 for p in t.model.parameters())
    seconds, loss = t.step()
    assert seconds > 0 and math.isfinite(loss)


_JITTER = (1.3, 0.9, 1.0, 1.1, 0.95, 1.05, 1.0, 0.92, 1.08)


def _result(mode, step, peak, jitter=_JITTER):
    times = [step * f for f in jitter]
    r = runner.ModeResult(mode, step_times=times, train_losses=[2.3] * len(times))
    r.median_step = statistics.median(times[1:])
    r.final_metric, r.peak_bytes = 0.5, peak
    return r


def _verdict(storage_step, storage_peak, o2_step=0.270, jitter=_JITTER):
    results = {
        "fp32": _result("fp32", 0.016, 15 * 2**20),
        "O2 bf16": _result("O2", o2_step, 11 * 2**20),
        ROW: _result(demo.STORAGE, storage_step, storage_peak, jitter),
    }
    lines = demo.verdict(results, SLOW, torch.bfloat16).split("\n")
    return next(s for s in lines if s.startswith("Speed:")), next(
        s for s in lines if s.startswith("Pick:")
    )


def test_the_pick_follows_the_measured_numbers():
    # as fast as fp32 in some rounds, and leaner: storage-only
    speed, pick = _verdict(0.0161, 9 * 2**20, jitter=(1.3, 0.8, 1.0, 1.1, 0.9, 1.05, 1.2, 0.9, 1))
    assert pick.startswith(f"Pick: {ROW}: it used 40% less peak memory than fp32, and this run")
    assert "O2 bf16" in speed and ROW not in speed  # even where it is the fastest mixed mode
    # measurably slower than fp32 every round, leaner: it for memory, fp32 for time
    _, pick = _verdict(0.020, 9 * 2**20)
    assert pick.startswith(f"Pick: {ROW} where memory is the aim (40% less peak memory than fp32")
    assert "fp32 where step time is; the 16-bit-compute levels took 16.9x" in pick
    assert "(the leanest" not in pick  # O2's 11 MB is more than storage-only's 9 MB
    _, pick = _verdict(0.020, 13 * 2**20)
    assert (
        "took 16.9x fp32's median step at best (the leanest, O2 bf16, 11 MB against its 13 MB)"
        in pick
    )
    # no memory saved: fp32
    _, pick = _verdict(0.016, 15 * 2**20)
    assert pick.startswith(f"Pick: fp32: {ROW} used no less peak memory than fp32")
    # a 16-bit level stepped faster: that level, said so
    _, pick = _verdict(0.300, 9 * 2**20)
    assert pick.startswith(f"Pick: O2 bf16 rather than {ROW}: its median step was shorter")
