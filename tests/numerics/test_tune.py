"""Precision tuning finds the planted unstable layer, nothing else, and the plan trains."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from tests.training_helpers import assert_tree_bitwise

warnings.filterwarnings("ignore", category=Warning, module="mixprec")


class Net(nn.Module):
    """``amp`` is the planted unstable layer: its activations (~1e5) exceed fp16's 65504;
    the LayerNorm after it brings them back, so the model is fine in fp32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.amp = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)
        with torch.no_grad():
            self.amp.weight.mul_(1e6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.amp(torch.relu(self.inp(x))))))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()


def test_tune_finds_the_planted_layer_and_nothing_else():
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = mixprec.numerics.tune(model, _data(), F.cross_entropy, torch.float16, tolerance=0.05)
    assert plan.fp32_modules == ["amp"]
    assert dict(plan) == {"amp": mixprec.Policy("float32")}
    assert math.isinf(plan.before.loss) and plan.passed and plan.after.grad < 0.05
    assert math.isinf(plan.sensitivity["amp"])
    assert "non-finite" in plan.reasons["amp"] and "amp" in plan.explain()
    # tune leaves the model as it found it: weights, gradients, policies
    assert_tree_bitwise(before, dict(model.state_dict()))
    assert all(p.grad is None for p in model.parameters())
    assert all(mixprec.get_policy(m) is None for m in model.modules())


def test_the_tuned_policy_trains_where_the_untuned_one_overflows():
    plan = mixprec.numerics.tune(Net(), _data(), F.cross_entropy, torch.float16)
    x, y = _data()

    def train(tuned: bool):
        model = Net()
        if tuned:
            plan.apply(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = mixprec.initialize(model, opt, "O2", torch.float16)
        losses = []
        for _ in range(15):
            loss = F.cross_entropy(model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, opt

    bad, bad_opt = train(False)
    assert all(not math.isfinite(v) for v in bad) and bad_opt.skipped_steps == 15
    good, good_opt = train(True)
    assert all(math.isfinite(v) for v in good) and good_opt.skipped_steps == 0
    assert good[-1] < good[0] * 0.8


def test_a_stable_model_needs_nothing_in_fp32_and_containers_map_their_children():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    plan = mixprec.numerics.tune(model, [(x, y), (x * 2, y)], F.mse_loss, "bf16", tolerance=0.05)
    assert dict(plan) == {} and plan.evaluations == 1 and plan.passed
    # forcing a tolerance nothing can meet in bf16 keeps candidates in fp32; a container
    # chosen maps its direct children back to 16-bit
    tight = mixprec.numerics.tune(
        model,
        (x, y),
        F.mse_loss,
        torch.bfloat16,
        tolerance=1e-9,
        candidates=[""],
        max_evaluations=4,
    )
    assert tight.fp32_modules == [""]
    assert tight[""] == mixprec.Policy("float32")
    assert tight["0"] == mixprec.Policy("mixed_bfloat16")


def test_bad_arguments():
    model = Net()
    with pytest.raises(ValueError, match="16-bit"):
        mixprec.numerics.tune(model, _data(), F.cross_entropy, torch.float32)
    with pytest.raises(ValueError, match="tolerance"):
        mixprec.numerics.tune(model, _data(), F.cross_entropy, torch.float16, tolerance=0)
    with pytest.raises(TypeError, match="batch="):
        mixprec.numerics.tune(model, torch.randn(4, 16), F.cross_entropy)
