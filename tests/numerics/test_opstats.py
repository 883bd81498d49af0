"""Op statistics: counts per op and dtype match a hand count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_forward_counts_match_a_hand_count():
    model, x = _mlp(), torch.randn(4, 8)
    with torch.no_grad(), mixprec.numerics.op_stats() as stats, mixprec.autocast(torch.bfloat16):
        model(x).sum()
    # Hand count. Linear 1: x, weight, bias cast to bf16 (3 _to_copy), F.linear decomposes into
    # t + addmm. ReLU: relu in bf16. Linear 2: weight and bias cast (2 _to_copy; its input is
    # already bf16), t + addmm. sum is an fp32-rule op: its input is cast to fp32 (1 _to_copy
    # counted under fp32, the dtype it casts to) and sum runs in fp32.
    assert stats.as_dict() == {
        "_to_copy": {"fp32": 1, "bf16": 5, "fp16": 0, "fp8": 0, "other": 0},
        "addmm": {"fp32": 0, "bf16": 2, "fp16": 0, "fp8": 0, "other": 0},
        "relu": {"fp32": 0, "bf16": 1, "fp16": 0, "fp8": 0, "other": 0},
        "sum": {"fp32": 1, "bf16": 0, "fp16": 0, "fp8": 0, "other": 0},
        "t": {"fp32": 0, "bf16": 2, "fp16": 0, "fp8": 0, "other": 0},
    }
    assert stats.totals() == {"fp32": 2, "bf16": 10, "fp16": 0, "fp8": 0, "other": 0}
    assert stats.as_dict("backward") == {}


def test_backward_is_counted_separately():
    model, x = _mlp(), torch.randn(4, 8)
    with mixprec.numerics.op_stats() as stats:
        with mixprec.autocast(torch.bfloat16):
            loss = model(x).sum()
        loss.backward()
    back = stats.as_dict("backward")
    # weight grads of both layers and the input grad of layer 2 (x needs no grad): 3 bf16 mm
    assert back["mm"] == {"fp32": 0, "bf16": 3, "fp16": 0, "fp8": 0, "other": 0}
    assert back["threshold_backward"]["bf16"] == 1  # relu's backward
    # gradients come back to the fp32 parameters through fp32 casts: 4 (2 weights, 2 biases)
    assert back["_to_copy"]["fp32"] == 4
    merged = stats.as_dict()
    assert merged["addmm"]["bf16"] == 2 and merged["mm"]["bf16"] == 3


def test_fp32_model_counts_fp32_and_other_categories():
    model, x = _mlp(), torch.randn(4, 8)
    with torch.no_grad(), mixprec.numerics.op_stats() as stats:
        y = model(x)
        (y > 0).sum()
        torch.arange(3)
    d = stats.as_dict()
    assert d["addmm"]["fp32"] == 2 and d["gt"]["fp32"] == 1  # compare: counted by its input
    assert d["arange"]["other"] == 1  # no floating tensor at all
    assert stats.totals()["bf16"] == stats.totals()["fp16"] == 0


def test_table_has_every_op_and_a_total():
    model, x = _mlp(), torch.randn(4, 8)
    with torch.no_grad(), mixprec.numerics.op_stats() as stats, mixprec.autocast(torch.bfloat16):
        model(x)
    table = stats.table()
    lines = table.splitlines()
    assert lines[0].split() == ["op", "fp32", "bf16", "fp16", "fp8", "other", "total"]
    assert lines[-1].split() == [
        "TOTAL",
        "0",
        "10",
        "0",
        "0",
        "0",
        "10",
    ]  # 5 casts, 2 t, 2 addmm, relu
    assert any(line.split()[:3] == ["addmm", "0", "2"] for line in lines)
    with pytest.raises(ValueError, match="phase"):
        stats.as_dict("sideways")
    stats.reset()
    assert stats.as_dict() == {}
