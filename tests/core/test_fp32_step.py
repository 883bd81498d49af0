"""torch's fused Adam/AdamW/SGD for mixprec's fp32 steps where the user left foreach and fused
at None (core/update/fp32_step.py); an explicit choice is the user's."""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec
from mixprec._core.update import spec

BF16 = torch.bfloat16


def _counting(monkeypatch, name):
    calls = []
    real = getattr(torch, name)

    def wrapper(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, name, wrapper)
    return calls


def _step(level, opt_fn, **recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = mixprec.initialize(
            model, opt_fn(model.parameters()), mixprec.Recipe(level, BF16, **recipe)
        )
    for _ in range(2):
        opt.backward(model(torch.randn(4, 8)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_defaults_run_torchs_fused_kernel_and_leave_the_groups_as_built(level, monkeypatch):
    """O2's masters and O3's reference (its chunk path) step through torch's fused kernel."""
    monkeypatch.setattr(spec, "CPU_BACKEND", "chunk")
    calls = _counting(monkeypatch, "_fused_adamw_")
    opt = _step(level, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert calls, "the fused kernel did not run"
    assert all(g["fused"] is None and g["foreach"] is None for g in opt.param_groups)
    assert opt.state_dict()["param_groups"][0]["fused"] is None


def test_sgd_defaults_run_the_fused_sgd_kernel(monkeypatch):
    monkeypatch.setattr(spec, "CPU_BACKEND", "chunk")  # the reference's fp32 temporaries
    calls = _counting(monkeypatch, "_fused_sgd_")
    _step("O3", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), update="kahan")
    assert calls


@pytest.mark.parametrize("choice", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_an_explicit_choice_is_respected(choice, monkeypatch):
    calls = _counting(monkeypatch, "_fused_adamw_")
    _step("O2", lambda ps: torch.optim.AdamW(ps, lr=1e-3, **choice))
    _step("O3", lambda ps: torch.optim.AdamW(ps, lr=1e-3, **choice))
    assert not calls


def test_update_none_and_subclasses_keep_torchs_default(monkeypatch):
    calls = _counting(monkeypatch, "_fused_adamw_")

    class MyAdamW(torch.optim.AdamW):
        pass

    _step("O3", lambda ps: torch.optim.AdamW(ps, lr=1e-3), update=None)  # 16-bit params
    _step("O2", lambda ps: MyAdamW(ps, lr=1e-3))
    assert not calls
