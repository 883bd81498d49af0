"""The benchmark scripts run their whole code path on a CPU (tiny shapes) and refuse what
cannot work here with a clear message."""

from __future__ import annotations

import json
import math
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_fp8
import bench_gpu
import bench_memory
import bench_nanogpt
import bench_overhead
import bench_state
import bench_update_kernels
import torch

from mixprec._core.update import c_loop


def test_bench_fp8_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    threads = torch.get_num_threads()
    bench_fp8.main(["--device", "cpu", "--smoke", "--rounds", "1", "--json", str(out)])
    assert torch.get_num_threads() == threads
    text = capsys.readouterr().out
    assert "FP8 emulated" in text and "torch " in text
    doc = json.loads(out.read_text())
    assert len(doc["gemm"]) == 8 and all(r["tensorwise_speedup"] > 0 for r in doc["gemm"])
    assert doc["layer"][0]["rowwise_ms"] > 0
    step = {r["mode"]: r for r in doc["step"]}
    assert step["O2 + FP8 tensorwise"]["fp8_layers"] == 8 and step["bf16 O2"]["fp8_layers"] == 0
    assert step["O2 + FP8 auto"]["fp8_layers"] == 0  # too small to gain on an H100
    assert step["O2 + FP8 rowwise"]["speed_vs_bf16"] > 0
    assert (
        "error" in step["torchao float8 tensorwise"]
        or "step_ms" in step["torchao float8 tensorwise"]
    )
    runs = doc["curves"]["runs"]
    assert {r["mode"] for r in runs} == {"bf16 O2", "FP8 tensorwise", "FP8 rowwise"}
    assert all(len(r["losses"]) == 5 for r in runs)
    assert "(c) loss after 5 steps" in text and "| O2 + FP8 rowwise | 8 |" in text


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


def test_bench_gpu_races_compiled_against_compiled_and_runs_activation_modes(tmp_path, capsys):
    refs = {m.label: m.reference for m in bench_gpu.MODES}
    assert refs["mixprec O2 bf16 + compile"] == "torch.autocast bf16 + compile"
    assert refs["mixprec graph pass bf16 + compile"] == "torch.autocast bf16 + compile"
    assert refs["mixprec O3 fp16 + compile"] == "torch.autocast fp16 + compile"
    assert refs["mixprec O2 bf16"] == "torch.autocast bf16"
    assert refs["fp32 + TF32"] == "torch.autocast bf16"
    assert set(refs.values()) <= set(refs)  # every reference is itself a row
    bench_gpu.main(
        [
            "--device", "cpu", "--smoke", "--rounds", "2", "--steps", "1", "--modes",
            "torch.autocast bf16", "mixprec O3 bf16, activations=fp8",
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert "| mixprec O3 bf16, activations=fp8 |" in text and "vs torch.autocast bf16" in text


@pytest.mark.parametrize("mode", ["fp32", "torch-autocast", "O2", "O3", "O3-update-none"])
def test_bench_state_trains_each_mode_and_counts_bytes_per_parameter(mode):
    """Tiny shapes: the numbers are the allocator's, the code path is the benchmark's."""
    for name in bench_state.MODELS:
        row = bench_state.child(name, mode, steps=2, scale=0.05)
        assert row["params"] > 0 and math.isfinite(row["bytes_per_param"]) and row["step_ms"] > 0
        assert math.isfinite(row["loss"])
    assert f"| gpt | {mode} |" in bench_state.table([row])


@pytest.mark.parametrize(
    ("mode", "loop"),
    [
        ("lean", "clip-accum"),
        ("bf16-weights+fused", "clip"),
        ("O3", "plain"),
        ("lean-fp32-compute", "plain"),
    ],
)
def test_bench_state_loops_report_each_step_and_the_recipe_table(mode, loop):
    """``--loops``' code path in tiny shapes: a peak per step, the summary and the table row."""
    raw = bench_state.child_loop("mlp", mode, loop, steps=2, scale=0.05)
    assert len(raw["peak_bytes"]) == 2 and raw["params"] > 0 and math.isfinite(raw["loss"])
    assert raw["backward"] == ("loss.backward()" if loop == "clip-accum" or "+" in mode
                               else "opt.backward(loss)")  # fmt: skip
    row = bench_state._loop_row(raw)
    assert row["max_1_4"] == max(row["step_1"], row["steps_2_on_max"])
    if mode == "bf16-weights+fused":
        assert row["table"] is None and row["gap"] is None
    else:
        clips = loop != "plain"  # "lean" codes the gradients there: +1 B/param
        assert row["table"] == {"lean": 4.0, "O3": 12.0, "lean-fp32-compute": 4.0}[mode] + (
            1.0 if clips and mode.startswith("lean") else 0.0
        )
        assert row["gap"] == round(row["max_1_4"] - row["table"], 2)
    assert f"| mlp | {mode} | {loop} |" in bench_state.loop_table([row], steps=2)


def test_bench_memory_measures_one_mode_in_its_process():
    row = bench_memory.child("O3+fp8", torch.bfloat16, steps=1, batch=1)
    assert row["peak_mb"] > row["runtime_mb"] > 0 and row["added_mb"] > 0
    assert 0 < row["saved_mb"] < row["tensor_mb"]
    plain = bench_memory.child("O3", torch.bfloat16, steps=1, batch=1)
    assert row["saved_mb"] < 0.6 * plain["saved_mb"]  # FP8: half the bytes, GELU recomputed
    table = bench_memory.memory_table([{**plain, "mode": "O3", "runs": [1.0]}])
    assert "| O3 |" in table
    with pytest.raises(ValueError, match="apply to the levels"):
        bench_memory.parse_mode("torch-autocast+fp8")
    assert bench_memory.parse_mode("O2+recompute@compile") == ("O2", "recompute", True)


def test_bench_gpu_profiles_modes(capsys):
    bench_gpu.main(["--device", "cpu", "--smoke", "--profile", "--modes", "mixprec O2 bf16"])
    text = capsys.readouterr().out
    assert "### gpt2-small: mixprec O2 bf16 (3 steps)" in text and "Self CPU" in text


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


def test_gpu_check_quick_dry_run_writes_every_table(tmp_path):
    """The one command a short GPU lease runs, run here on a CPU in tiny shapes: it must work
    before a GPU ever runs it, and leave no more files than the device tool brings back."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "quick", "--dry-run"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"machine.txt", "cuda_tests.txt", "race.json", "race.md", "fp8.json",
                     "fp8.md", "summary.md"}  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert "CPU dry run" in summary and "skipped" in summary  # the CUDA tier, collected
    for row in ("| gpt2-small | torch.autocast bf16 + compile |", "| O2 + FP8 rowwise | 8 |"):
        assert row in summary
    race = json.loads((tmp_path / "race.json").read_text())["rows"]
    assert all(r["error"] is None and r["median"] > 0 for r in race)
    assert "vs torch.autocast bf16 + compile" in summary  # compiled raced against compiled
    fp8 = {r["mode"] for r in json.loads((tmp_path / "fp8.json").read_text())["step"]}
    assert fp8 == set(bench_fp8.QUICK_STEP)


NANOGPT_LINES = """\
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':
"""


def test_bench_nanogpt_edits_train_py_by_one_line_per_mode_and_makes_its_corpus(tmp_path):
    """The only edits to nanoGPT's train.py: autocast's ctx, or the initialize line right after
    configure_optimizers; the corpus is nanoGPT's data layout, made from stdlib sources."""
    assert bench_nanogpt.patched(NANOGPT_LINES, "fp32") == NANOGPT_LINES
    amp = bench_nanogpt.patched(NANOGPT_LINES, "torch-autocast").splitlines()
    assert amp[0].startswith("ctx = torch.autocast('cpu', torch.bfloat16) if True else")
    assert amp[1:] == NANOGPT_LINES.splitlines()[1:]
    lines = bench_nanogpt.patched(NANOGPT_LINES, "lean").splitlines()
    assert lines[2] == (
        "import mixprec; model, optimizer = mixprec.initialize(model, optimizer, 'lean', "
        "torch.bfloat16)"
    )
    assert [lines[0], lines[1], lines[3]] == NANOGPT_LINES.splitlines()
    with pytest.raises(SystemExit, match="configure_optimizers line was not found"):
        bench_nanogpt.patched("print()\n", "O2")
    bench_nanogpt.corpus(tmp_path, 5000)
    meta = pickle.loads((tmp_path / "meta.pkl").read_bytes())
    ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert len(ids) == 4500 and int(ids.max()) < meta["vocab_size"] == len(meta["itos"])


@pytest.mark.skipif(not c_loop.available(), reason="no C compiler here")
def test_bench_update_kernels_times_every_kind_and_its_bandwidth(capsys):
    bench_update_kernels.main(["--size", "0.02", "--rounds", "1"])
    text = capsys.readouterr().out
    assert "torch 2." in text and "copy" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # the header
    assert len(rows) == 1 + len(bench_update_kernels.KINDS)
    for row in rows:
        ms = float(row.split("|")[3])
        assert ms > 0, row
