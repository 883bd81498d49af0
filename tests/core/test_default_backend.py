"""The suite runs the update a user gets by default: no fixture or conftest switches the one-pass
update's backend, and a plain training step here is stepped by the backend a user's is."""

from __future__ import annotations

import subprocess
import sys
import warnings

import torch

import mixprec
from mixprec._core.update import c_loop, spec


def test_the_suites_backend_switches_are_a_fresh_interpreters():
    code = "from mixprec._core.update import spec; print(spec.CPU_BACKEND, spec.MIN_NUMEL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [spec.CPU_BACKEND, str(spec.MIN_NUMEL)]
    assert spec.CPU_BACKEND == "c"


def test_a_users_lean_step_runs_the_c_loop_here():
    """Every 16-bit parameter of a default "lean" run takes one pass of the C loop, from the
    first step on, where the machine has a C compiler (the chunk path, saying so, where not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, "lean", torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.backward(model(torch.randn(4, 64)).float().square().mean())
        opt.step()
    lines = opt.updater.explain().splitlines()
    assert len(lines) == 4
    if c_loop.available():
        assert all(line.endswith("c: one pass") for line in lines), lines
        assert opt.updater.fused.fused_steps == 4
    else:
        assert any("could not be compiled" in str(w.message) for w in seen)
