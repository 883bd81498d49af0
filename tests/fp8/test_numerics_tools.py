"""The numerics tools see FP8 layers: op_stats counts the scaled matmuls, range_audit judges each
FP8 layer's casts at its recipe's scales, mixprec report prints the plan and the casts, and tune
chooses fp8 / 16-bit / fp32 per Linear."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import FP8Config
from mixprec.bench.models import GPT, GPTConfig
from mixprec.fp8 import fp8_plan
from mixprec.fp8.layers import layers_of

pytestmark = pytest.mark.filterwarnings("ignore:FP8 on CPU is emulated")
ALL = FP8Config(layers="all")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def ce(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def test_op_stats_counts_the_scaled_matmuls_in_their_own_column():
    model = mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=ALL))
    x = tokens()
    with mixprec.numerics.op_stats() as stats:
        ce(model(x), x).backward()
    fwd, bwd = stats.as_dict("forward"), stats.as_dict("backward")
    assert fwd["_scaled_mm"] == {"fp32": 0, "bf16": 0, "fp16": 0, "fp8": 8, "other": 0}
    assert bwd["_scaled_mm"]["fp8"] == 16  # input and weight gradient of each FP8 layer
    assert fwd["_to_copy"]["fp8"] > 0  # the casts into FP8 are counted as FP8 traffic
    assert stats.totals()["fp8"] > 24
    assert "fp8" in stats.table().splitlines()[0].split()


def test_range_audit_judges_fp8_layers_at_their_recipes_scales():
    model = mixprec.initialize(
        gpt(), None, mixprec.Recipe("O2", fp8=FP8Config("rowwise", layers="all"))
    )
    x = tokens()
    with mixprec.numerics.range_audit(model) as audit:
        ce(model(x), x).backward()
    fp8 = set(fp8_plan(model).chosen)
    assert set(audit.fp8) == fp8 and "head" not in audit.fp8
    s = audit.fp8["blocks.0.fc"]
    assert s.recipe == "rowwise" and s.calls == 1
    assert s.input.dtype == "float8_e4m3fn" and s.grad.dtype == "float8_e4m3fn"
    assert s.input.amax > 0 and s.input.underflow < 0.01 and s.input.overflow == 0
    assert s.input.sqnr > 25 and s.weight.sqnr > 25 and s.grad.sqnr > 25
    assert 18 < s.output_sqnr < 60  # FP8 against the same layer in 16 bits
    table = audit.table("bf16")
    assert "FP8 layer" in table and "blocks.0.fc" in audit.fp8_table()
    d = audit.as_dict()["fp8"]["blocks.0.fc"]
    assert d["recipe"] == "rowwise" and d["input"]["sqnr"] == s.input.sqnr


def test_range_audit_sees_an_input_outside_the_fp8_range():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    model = mixprec.initialize(model, None, mixprec.Recipe("O2", fp8=ALL))
    x = torch.randn(8, 32)
    x[:, 0] = 1e7  # per-tensor scaling pushes everything else under e4m3's smallest value
    with torch.no_grad(), mixprec.numerics.range_audit(model) as audit:
        model(x)
    first = audit.fp8["0"]
    assert first.input.amax == pytest.approx(1e7, rel=1e-2)
    # SQNR weighs by energy and the outlier holds nearly all of it; the fraction outside the
    # range is what shows that the rest of the input was lost
    assert first.input.underflow > 0.9 and first.input.overflow == 0
    row = next(line for line in audit.fp8_table().splitlines() if line.startswith("0 "))
    assert row.split()[3].endswith("%") and float(row.split()[3][:-1]) > 90


def test_report_with_fp8_prints_the_plan_the_fp8_casts_and_names_fp8_layers(tmp_path, capsys):
    from mixprec.numerics.report import run_report

    model = gpt()
    x = tokens()
    before = [p.detach().clone() for p in model.parameters()]
    doc = run_report(
        model,
        (x, x),
        None,
        dtype=torch.bfloat16,
        steps=1,
        out=tmp_path,
        plots=False,
        fp8=ALL,
    )
    out = capsys.readouterr().out
    assert "FP8 plan (tensorwise" in out and "FP8 layers (tensorwise)" in out
    assert "blocks.0.fc" in doc["fp8"] and doc["fp8"]["blocks.0.fc"]["output_sqnr_vs_16bit"] > 18
    assert doc["fp8_plan"]["head"]["fp8"] is False
    assert doc["op_stats"]["forward"]["_scaled_mm"]["fp8"] == 8
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["fp8"].keys() == doc["fp8"].keys()
    # the model given is untouched: no FP8 forwards left on it, weights the same
    assert layers_of(model) == {} and not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_tune_chooses_fp8_16_bit_or_fp32_per_linear():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
        nn.Linear(64, 8),
    )  # fmt: skip
    with torch.no_grad():
        model[2].weight[:, 0] *= 1e4  # a weight column 1e4x the rest: FP8 costs accuracy there
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))

    def loss(out, target):
        return F.cross_entropy(out.float(), target)

    plan = mixprec.numerics.tune(
        model, (x, y), loss, mixprec.Recipe("O2", torch.bfloat16, fp8=ALL), tolerance=0.05
    )
    assert plan.passed and plan.fp32_modules == []
    assert "0" in plan.fp8_modules and "2" not in plan.fp8_modules
    assert "in FP8: loss error" in plan.fp8_reasons["2"]
    assert "output head" in plan.fp8_reasons["5"]
    assert "FP8 (tensorwise): 0" in plan.explain()
    assert plan.as_dict()["fp8_modules"] == plan.fp8_modules
    # the model is left as it was, and the plan's fp8= trains exactly those layers
    assert layers_of(model) == {} and not any("forward" in m.__dict__ for m in model.modules())
    trained = mixprec.initialize(model, None, mixprec.Recipe("O2", fp8=plan.fp8))
    assert fp8_plan(trained).chosen == plan.fp8_modules

    def accuracy(out, target):
        return (out.argmax(-1) == target).float().mean()

    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    by_metric = mixprec.numerics.tune(
        fresh,
        (x, y),
        metric=accuracy,
        recipe=mixprec.Recipe("O2", torch.bfloat16, fp8=ALL),
        tolerance=0.05,
    )
    assert by_metric.fp8_modules == ["0", "2"] and by_metric.passed
    assert mixprec.numerics.tune(fresh, (x, y), loss, torch.bfloat16).fp8 is None  # not asked


def test_mixprec_report_cli_takes_fp8_and_its_layers(tmp_path, capsys):
    from mixprec.cli.commands import main

    code = main(["report", "--fp8", "rowwise", "--fp8-layers", "all", "--no-plots", "--steps",
                 "1", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "FP8 plan (rowwise" in out and "FP8 layers (rowwise)" in out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert len(doc["fp8"]) == 8 and all(v["recipe"] == "rowwise" for v in doc["fp8"].values())
