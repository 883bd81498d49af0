"""A PyTorch-recipe training loop runs unchanged on mixprec.amp, step for step like torch.amp.

The loop is the AMP recipe's: ``autocast`` around the forward, ``GradScaler`` around backward
and step, gradient accumulation over 4 micro-batches, clipping after ``unscale_``, an LR
scheduler, and a checkpoint saved mid-run and resumed by a fresh model, optimizer, scheduler and
scaler. It is written once against an ``amp`` namespace and run with ``torch.amp`` and with
``mixprec.amp``: losses, weights and scaler state must be bitwise equal, in float16 (where the
scaler skips steps) and bfloat16, and the scaler state must load across the two.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.amp

ACCUM, STEPS, SAVE_AT = 4, 5, 2


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(amp, dtype, path, *, start=0, stop=STEPS, save_at=None, resume_into=None) -> dict:
    """The recipe loop, steps ``start`` to ``stop``; optionally resumes from / saves to
    ``path``. ``resume_into`` picks the amp namespace whose scaler loads the checkpoint."""
    model, opt, sched = build()
    scaler = amp.GradScaler("cpu", init_scale=2.0**20 if dtype == torch.float16 else 2.0**16)
    if start:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
    losses = []
    for step in range(start, stop):
        for micro in range(ACCUM):
            x, y = micro_batch(step, micro)
            with amp.autocast(device_type="cpu", dtype=dtype):
                loss = F.cross_entropy(model(x), y) / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == save_at:
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "scaler": scaler.state_dict(),
                },
                path,
            )
    return {"losses": losses, "model": model.state_dict(), "scaler": scaler}


def run(amp, dtype, path, **kwargs) -> dict:
    with warnings.catch_warnings():
        # the recipe steps the scheduler after a skipped first step; torch warns about it
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
        warnings.filterwarnings("ignore", "GradScaler is enabled but autocast regions")
        return train(amp, dtype, path, **kwargs)


@functools.cache
def uninterrupted(amp_name: str, dtype: torch.dtype) -> dict:
    """A whole run, kept for the tests that compare against it (no checkpoint written)."""
    return run({"torch": torch.amp, "mixprec": mixprec.amp}[amp_name], dtype, None)


def assert_same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert a["scaler"].state_dict() == b["scaler"].state_dict()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_recipe_loop_runs_unchanged_with_torchs_trajectory(dtype):
    ref, ours = uninterrupted("torch", dtype), uninterrupted("mixprec", dtype)
    assert_same(ref, ours)
    assert ref["losses"][-1] < ref["losses"][0]
    if dtype == torch.float16:  # init_scale 2**20 overflows float16 gradients at first
        assert ours["scaler"].skipped_steps >= 1
        assert ours["scaler"].get_scale() < 2.0**20
    else:
        assert ours["scaler"].skipped_steps == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("saver", "loader"),
    [(mixprec.amp, mixprec.amp), (torch.amp, mixprec.amp), (mixprec.amp, torch.amp)],
    ids=["mixprec-mixprec", "torch-mixprec", "mixprec-torch"],
)
def test_checkpoint_resume_continues_the_same_trajectory(saver, loader, dtype, tmp_path):
    path = tmp_path / "ckpt.pt"
    full = uninterrupted("torch", dtype)
    first = run(saver, dtype, path, stop=SAVE_AT + 1, save_at=SAVE_AT)
    rest = run(loader, dtype, path, start=SAVE_AT + 1)
    assert first["losses"] + rest["losses"] == full["losses"]
    for k, v in full["model"].items():
        assert torch.equal(v, rest["model"][k]), k
    assert rest["scaler"].state_dict() == full["scaler"].state_dict()


def test_scaler_state_loads_into_torch_and_back():
    ours = uninterrupted("mixprec", torch.float16)["scaler"]
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    back = mixprec.amp.GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == ours.state_dict()
    assert set(ours.state_dict()) == {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }
