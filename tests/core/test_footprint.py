"""mixprec.numerics.footprint: bytes per parameter by category, counted from the live tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.numerics import footprint

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16 = torch.bfloat16


def make(level=None, opt="adamw", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))  # no norm layers
    if opt == "adamw":
        o = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        o = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if level is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, o = mixprec.initialize(model, o, mixprec.Recipe(level, BF16, **kw))
    x = torch.randn(32, 64)

    def step():
        loss = model(x).float().pow(2).mean()
        if level is None:
            loss.backward()
        else:
            o.backward(loss)
        o.step()
        o.zero_grad()

    return model, o, step


# the expected bytes per parameter, exact up to Adam's scalar "step" tensors (4 B per tensor)
@pytest.mark.parametrize(
    ("level", "kw", "opt", "expect"),
    [
        (None, {}, "adamw", dict(weights=4, grads=4, masters=0, compensation=0, optimizer_state=8)),
        ("O2", {}, "adamw", dict(weights=2, grads=6, masters=4, compensation=0, optimizer_state=8)),
        (
            "O3",
            dict(update=None),  # the optimizer's own bf16 step: bf16 m and v
            "adamw",
            dict(weights=2, grads=2, masters=0, compensation=0, optimizer_state=4),
        ),
        (
            "O3",
            {},  # bf16's default update is "kahan": bf16 m, fp32 v, bf16 compensation
            "adamw",
            dict(weights=2, grads=2, masters=0, compensation=2, optimizer_state=6),
        ),
        ("O3", {}, "sgd", dict(weights=2, grads=2, masters=0, compensation=2, optimizer_state=2)),
        (
            "O3",
            dict(update="kahan"),
            "adamw",
            dict(weights=2, grads=2, masters=0, compensation=2, optimizer_state=6),
        ),
        (
            "O3",
            dict(update="kahan", optimizer_states=BF16),
            "adamw",
            dict(weights=2, grads=2, masters=0, compensation=2, optimizer_state=4),
        ),
        (
            "O3",
            dict(update="stochastic", optimizer_states=torch.float32),
            "adamw",
            dict(weights=2, grads=2, masters=0, compensation=0, optimizer_state=8),
        ),
        (
            "O3",
            dict(update="kahan"),
            "sgd",
            dict(weights=2, grads=2, masters=0, compensation=2, optimizer_state=2),
        ),
    ],
)
def test_bytes_per_param_by_configuration(level, kw, opt, expect):
    model, o, step = make(level, opt, **kw)
    fp = footprint(model, o, step=step)
    per = fp.per_param
    assert fp.params == sum(p.numel() for p in model.parameters())
    for k, v in expect.items():
        assert per[k] == pytest.approx(v, abs=0.01), (k, per)
    assert per["total"] == pytest.approx(sum(expect.values()), abs=0.01)
    # the measured steps create the optimizer state, so their peak holds it (half of it at
    # least: the resident set is measured, and pages freed during the steps count against it);
    # a process's whole resident set (~230 MB with torch) is not a step's peak
    assert fp.peak_bytes is not None
    assert fp.bytes["optimizer_state"] // 2 <= fp.peak_bytes < 128 * 2**20, fp.peak_bytes
    assert "bytes/param" in str(fp)


def test_the_peak_counts_memory_freed_within_the_steps():
    """The peak is the high-water mark of the steps, not what is left at their end: a 32 MiB
    temporary that each step frees again shows in it (measured: 32.1 to 48 MiB; the bound
    leaves room for resident pages freed during the steps)."""
    model, o, step = make("O3")

    def step_with_a_temporary():
        step()
        big = torch.ones(8 * 2**20)  # 32 MiB, written: resident
        assert float(big[-1]) == 1.0

    peak = footprint(model, o, step=step_with_a_temporary).peak_bytes
    assert peak is not None and 24 * 2**20 <= peak < 128 * 2**20, peak


def test_without_step_counts_existing_tensors_only():
    model, o, _step = make("O3", update="kahan")
    fp = footprint(model, o)
    assert fp.peak_bytes is None
    assert fp.per_param["optimizer_state"] == 0  # not created until the first step
    assert fp.per_param["compensation"] == pytest.approx(2)
    assert footprint(model).per_param["weights"] == pytest.approx(2)


def test_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        footprint(torch.zeros(3))
    model, o, step = make()
    with pytest.raises(TypeError, match="Optimizer"):
        footprint(model, object())
    with pytest.raises(ValueError, match="steps"):
        footprint(model, o, step=step, steps=0)
