"""Recipe(gradients="coded"): each gradient coded in 8 bits (E4M3, a scale per 256) as its
backward completes it; clipping sees the norm torch would compute on the 16-bit gradients,
accumulation adds into the codes, a non-finite gradient skips the whole step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from training_helpers import assert_tree_bitwise

import mixprec
from mixprec._core.update.coded import BLOCK, code, decode, empty_codes

BF16 = torch.bfloat16
LR = 1e-3
MAX_NORM = 0.1  # below these gradients' norm: every clip scales


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _trained(gradients: str, loop: str, steps: int = 1, base: nn.Module | None = None):
    """(model, opt, clip norms) after ``steps`` of ``loop``: "plain", "clip" (torch's
    clip_grad_norm_ on the model's parameters), "opt-clip" (opt.clip_grad_norm_) or "accum"
    (two micro-batches of half the loss, then torch's clip)."""
    model = copy.deepcopy(base or _base())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    recipe = mixprec.Recipe("lean", BF16, gradients=gradients)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 may be slow on this CPU
        model, opt = mixprec.initialize(model, opt, recipe)
    norms = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        for _ in range(2 if loop == "accum" else 1):
            loss = (model(x).float() - y).pow(2).mean() * (0.5 if loop == "accum" else 1.0)
            loss.backward()
        if loop in ("clip", "accum"):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        elif loop == "opt-clip":
            norms.append(opt.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad()
    return model, opt, norms


@pytest.mark.parametrize("loop", ["clip", "opt-clip"])
def test_the_clip_sees_the_norm_torch_computes_on_the_16_bit_gradients(loop):
    _, _, held = _trained("held", loop)
    model, _, coded = _trained("coded", loop)
    assert held[0].dtype == coded[0].dtype == BF16
    assert torch.equal(held[0], coded[0])  # the norm exactly, not within the coding's error
    assert held[0] > MAX_NORM  # the clip scaled this step
    assert all(p.grad is None for p in model.parameters())  # the codes were the gradients


def test_the_clipped_update_is_within_the_coding_error():
    """AdamW's first step moves each weight by about lr whatever the gradient's size, so a
    gradient coded within 2**-4 moves the weights as the held one does, up to a weight's
    stochastic rounding landing one ulp apart."""
    held, _, _ = _trained("held", "clip")
    coded, _, _ = _trained("coded", "clip")
    for a, b in zip(held.parameters(), coded.parameters()):
        ulp = torch.finfo(BF16).eps * a.detach().float().abs().clamp(min=2**-8)
        assert ((a.float() - b.float()).abs() <= 2 * ulp + 1e-6).all()


def test_coding_errors_are_bounded_and_accumulation_is_unbiased():
    x = torch.linspace(-3, 3, 7 * BLOCK + 5) ** 3  # a wide range within each block
    buf = empty_codes(x.numel(), x.device)
    code(x, buf)
    back = decode(*buf, x.shape)
    scale = buf[1].repeat_interleave(BLOCK)[: x.numel()]
    normal = x.abs() >= scale * 2.0**-6  # E4M3's normal range within the block's scale
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0**-4).all()
    assert ((back - x).abs()[~normal] <= scale[~normal] * 2.0**-10).all()  # half a subnormal
    total = torch.zeros_like(x)
    for i in range(400):  # codes of x again and again, stochastically rounded
        code(x, buf, torch.Generator().manual_seed(i))
        total += decode(*buf, x.shape)
    assert (total / 400 - x).abs().mean() < 0.1 * (back - x).abs().mean()
    code(x, buf)
    code(x, buf, torch.Generator().manual_seed(0), add=True)  # one accumulation
    assert torch.allclose(decode(*buf, x.shape), 2 * x, rtol=2.0**-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [BLOCK, 1000, 3 * 2**18 + 17])
def test_the_c_loop_codes_and_decodes_as_the_torch_ops_do_bit_for_bit(dtype, n):
    """Codes, scales and decoded values; every one of E4M3's 256 codes decodes as torch's own
    conversion does (the C loop computes them, the torch path looks them up)."""
    from mixprec._core.update import c_loop

    if not c_loop.available():
        pytest.skip("no C compiler: the torch ops are the only path")
    torch.manual_seed(n)
    g = (torch.randn(n) * torch.logspace(-6, 2, n)[torch.randperm(n)]).to(dtype)
    ref, fast = empty_codes(n, g.device), empty_codes(n, g.device)
    code(g, ref)
    code(g, fast, c_loop=True)
    assert torch.equal(ref[0].view(torch.uint8), fast[0].view(torch.uint8))
    assert torch.equal(ref[1], fast[1])
    for coef in (None, 0.37):
        out = torch.empty(n, dtype=BF16)
        assert c_loop.decode_grad(ref[0].view(torch.uint8), ref[1], coef, out)
        want = decode(*ref, g.shape) * (1.0 if coef is None else torch.tensor(coef))
        assert torch.equal(out, want.to(BF16))
    every = torch.arange(256, dtype=torch.uint8).repeat(4)
    out = torch.empty(every.numel(), dtype=torch.float16)
    assert c_loop.decode_grad(every, torch.ones(4), None, out)
    want = every.view(torch.float8_e4m3fn).float().to(torch.float16)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(
        out[~out.isnan()], want[~want.isnan()]
    )


def test_accumulation_adds_into_the_codes():
    _, _, held = _trained("held", "accum", steps=2)
    model, opt, coded = _trained("coded", "accum", steps=2)
    for h, c in zip(held, coded):  # the first micro-batch's codes hold the sum: near
        assert float(c) == pytest.approx(float(h), rel=2.0**-4)
    codes = opt.updater._code_buffers
    assert codes and all(c.dtype == torch.float8_e4m3fn for (c, _), _ in codes.values())
    n = sum(p.numel() for p in model.parameters())
    stored = sum(c.numel() + 4 * s.numel() for (c, s), _ in codes.values())
    assert stored / n == pytest.approx(1 + 4 / BLOCK, abs=0.02)  # a byte and a block scale


def test_a_non_finite_gradient_skips_the_whole_step_and_leaves_everything_as_it_was():
    model, opt, _ = _trained("coded", "clip", steps=2)
    weights = [p.detach().clone() for p in model.parameters()]
    states = copy.deepcopy(opt.state_dict())
    x = torch.randn(16, 64)
    x[0, 0] = float("inf")
    model(x).float().pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    assert opt.step_skipped
    for a, b in zip(weights, model.parameters()):
        assert torch.equal(a, b.detach())
    after = opt.state_dict()
    assert_tree_bitwise(states["state"], after["state"])  # moments, step counts
    assert opt.updater.steps == 2 and opt.skipped_steps == 1  # the rounding's step count too
    assert not opt.updater._codes  # dropped with the step
    opt.zero_grad()
    model(torch.randn(16, 64)).float().pow(2).mean().backward()
    opt.step()
    assert not opt.step_skipped  # the next finite step steps


def test_coded_gradients_need_an_update_mode_and_no_loss_scaling():
    with pytest.raises(ValueError, match="coded"):
        mixprec.Recipe("O2", BF16, gradients="coded")
    with pytest.raises(ValueError, match="loss-scaled step must be skippable"):
        mixprec.Recipe("lean", torch.float16, gradients="coded", loss_scale="dynamic")
    table = mixprec.Recipe("lean", BF16, gradients="coded").table()
    assert "8-bit codes" in table and "by loop shape: plain 5.0, clip 5.0, accumulate 5.0" in table
