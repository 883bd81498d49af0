"""Behavioural tests for MixedPrecisionOptimizer through mixprec.initialize / scale_loss.

Covers: loss-scale trajectories through the optimizer, bitwise overflow skips at O1-O3, several
models / optimizers / losses, unscaled gradient clipping, gradient accumulation, fused vs foreach
AdamW, LR schedulers on skipped steps, add_param_group and plain ``loss.backward()`` usage.

Models are tiny (Linear(8,16)-ReLU-LayerNorm-Linear(16,4), batch 8) so fp16 on CPU is cheap.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from training_helpers import (
    INF,
    NAN,
    assert_bitwise,
    assert_tree_bitwise,
    batch,
    make_model,
    mse,
    poisoned,
)

import mixprec
from mixprec import LossScaling, initialize, scale_loss

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16 = torch.bfloat16, torch.float16


# --------------------------------------------------------------------------------- helpers


def snapshot(model: nn.Module, opt) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for _, m in opt._pairs],
        "state": copy.deepcopy(opt.optimizer.state_dict()),
    }


def changed(a: Tensor, b: Tensor) -> bool:
    return not torch.equal(a, b)


# ------------------------------------------------------------------ 1. scaler trajectories


def _trajectory_run(opt, model, verdicts, poison_param):
    x, y = batch()
    scales, skipped = [], []
    for bad in verdicts:
        loss = mse(model, x, y)
        before = opt.loss_scale
        with poisoned(poison_param if bad else None), scale_loss(loss, opt) as scaled:
            # the loss is multiplied by the scale in force before the step (exact: 2**k)
            assert scaled.item() == loss.item() * before
            scaled.backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
        skipped.append(opt.step_skipped)
    return scales, skipped


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_dynamic_trajectory_matches_closed_form(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = initialize(
        model,
        opt,
        mixprec.Recipe(level, FP16, loss_scale=LossScaling(init_scale=2.0**4, growth_interval=2)),
    )
    verdicts = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0]  # 1 = overflow injected
    scales, skipped = _trajectory_run(opt, model, verdicts, model[0].weight)
    # x2 after every 2 consecutive clean steps, /2 on every overflow (hysteresis 1)
    assert scales == [16, 32, 16, 16, 32, 32, 16, 8, 8, 16]
    assert skipped == [bool(v) for v in verdicts]
    assert opt.skipped_steps == 3
    sc = opt.slots[0].scaler
    assert (sc.steps, sc.skipped_steps, sc.growth_tracker) == (10, 3, 0)
    # a long clean run: closed form 16 * 2**(n // 2)
    scales, _ = _trajectory_run(opt, model, [0] * 7, None)
    assert scales == [16 * 2 ** ((n + 1) // 2) for n in range(7)]


def test_hysteresis_override_passes_through_initialize():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = initialize(
        model,
        opt,
        mixprec.Recipe(
            "O2",
            FP16,
            loss_scale=LossScaling(init_scale=2.0**4, growth_interval=2, hysteresis=2),
        ),
    )
    assert opt.slots[0].scaler.hysteresis == 2
    verdicts = [1, 1, 0, 1, 0, 1, 1]
    scales, skipped = _trajectory_run(opt, model, verdicts, model[3].bias)
    # two consecutive overflows per backoff; a clean step resets the count (and every
    # overflow step is skipped whether or not it backs off)
    assert scales == [16, 8, 8, 8, 8, 8, 4]
    assert skipped == [bool(v) for v in verdicts]
    assert opt.skipped_steps == 5


def test_static_loss_scale_never_changes_and_grads_are_unscaled():
    x, y = batch()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    ref, ref_opt = initialize(ref, ref_opt, mixprec.Recipe("O2", FP16, loss_scale=None))
    ref_opt.backward(mse(ref, x, y))
    ref_grads = [m.grad.clone() for m in ref_opt.master_params()]

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = initialize(model, opt, mixprec.Recipe("O2", FP16, loss_scale=128.0))
    assert opt.loss_scale == 128.0
    opt.backward(mse(model, x, y))
    for g, r in zip((m.grad for m in opt.master_params()), ref_grads):
        # same fp16 backward, 128x larger before unscaling: equal up to fp16 rounding
        torch.testing.assert_close(g, r, rtol=2e-3, atol=1e-5)
    opt.step()
    opt.zero_grad()
    scales, skipped = _trajectory_run(opt, model, [0, 0, 1, 0, 1, 1, 0, 0], model[0].bias)
    assert scales == [128.0] * 8
    assert skipped == [False, False, True, False, True, True, False, False]
    assert opt.skipped_steps == 3


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_no_loss_scaling_still_skips_on_inf(dtype):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, mixprec.Recipe("O2", dtype, loss_scale=None))
    assert opt.loss_scale == 1.0 and not opt.slots[0].scaler.enabled
    scales, skipped = _trajectory_run(opt, model, [0, 1, 0], model[2].weight)
    assert scales == [1.0, 1.0, 1.0]
    assert skipped == [False, True, False]
    assert opt.skipped_steps == 1


def test_bf16_defaults_to_no_scaling_fp16_to_dynamic():
    for dtype, expected in ((BF16, 1.0), (FP16, 2.0**16)):
        model = make_model()
        _, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype)
        assert opt.loss_scale == expected


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    verdicts=st.lists(st.booleans(), min_size=1, max_size=10),
    hysteresis=st.integers(1, 3),
    growth_interval=st.integers(1, 3),
)
def test_trajectory_through_optimizer_equals_bare_scaler(verdicts, hysteresis, growth_interval):
    """Whatever the clean/overflow sequence, the optimizer's scaler follows LossScaler's rule."""
    from mixprec._core.loss_scale import LossScaler

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = dict(init_scale=2.0**4, growth_interval=growth_interval, hysteresis=hysteresis)
    model, opt = initialize(model, opt, mixprec.Recipe("O2", FP16, loss_scale=LossScaling(**cfg)))
    ref = LossScaler(**cfg)
    scales, skipped = _trajectory_run(opt, model, verdicts, model[0].weight)
    expected = []
    for v in verdicts:
        ref.update(v)
        expected.append(ref.scale)
    assert scales == expected and skipped == verdicts
    assert opt.slots[0].scaler.state_dict() == ref.state_dict()


# ------------------------------------------------------------------ 2. bitwise overflow skip


@pytest.mark.parametrize("bad", [INF, NAN], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_overflow_in_each_param_skips_bitwise(level, dtype, bad):
    model = make_model()
    # eps=1e-4: at O3 fp16 the AdamW state is fp16 and the default eps=1e-8 rounds to 0, so a
    # zero gradient element gives 0/0 = NaN parameters on the first step (torch behaviour).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, opt = initialize(
        model,
        opt,
        mixprec.Recipe(
            level, dtype, loss_scale=LossScaling(init_scale=2.0**10, growth_interval=1000)
        ),
    )
    x, y = batch()
    opt.backward(mse(model, x, y))
    opt.step()  # one clean step so the inner optimizer has state to protect
    opt.zero_grad()
    assert not opt.step_skipped and opt.state
    assert len(opt._pairs) == (4 if level == "O2" else 0)

    params = list(model.parameters())
    for i, p in enumerate(params):
        before = snapshot(model, opt)
        scale, skipped = opt.loss_scale, opt.skipped_steps
        with poisoned(p, bad):
            opt.backward(mse(model, x, y))
        opt.step()
        assert opt.step_skipped, f"param {i}"
        assert opt.skipped_steps == skipped + 1
        assert opt.loss_scale == scale / 2
        after = snapshot(model, opt)
        assert_tree_bitwise(after, before)
        # the poisoned gradients are dropped, not carried into the next step
        assert all(q.grad is None for q in params)
        assert all(m.grad is None for m in opt.master_params())

    # training resumes normally after the skips
    before = snapshot(model, opt)
    opt.backward(mse(model, x, y))
    opt.step()
    assert not opt.step_skipped
    assert all(changed(a, b) for a, b in zip(before["params"], model.parameters()))


def test_overflow_via_inf_loss_skips():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, "O2", FP16)
    x, y = batch()
    before = snapshot(model, opt)
    opt.backward(mse(model, x, y) * INF)
    opt.step()
    assert opt.step_skipped and opt.loss_scale == 2.0**15
    assert_tree_bitwise(snapshot(model, opt), before)


# ------------------------------------------------------ 3. several models, optimizers, losses


@pytest.mark.parametrize("order", ["o1_first", "o2_first"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_multiple_models_optimizers_losses(level, order):
    m1, m2 = make_model(0), make_model(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    (m1, m2), (o1, o2) = initialize(
        [m1, m2],
        [o1, o2],
        mixprec.Recipe(
            level,
            FP16,
            num_losses=2,
            loss_scale=LossScaling(init_scale=2.0**6, growth_interval=2),
        ),
    )
    assert all(a is b for a, b in zip(o1.slots, o2.slots))  # one scaler per loss, shared
    x, y = batch()

    def iteration(poison0=None, poison1=None):
        snap1, snap2 = snapshot(m1, o1), snapshot(m2, o2)
        loss0 = mse(m1, x, y)
        with poisoned(poison0), scale_loss(loss0, o1, loss_id=0) as s:
            s.backward()
        loss1 = (m1(x).float() - m2(x).float()).pow(2).mean() + mse(m2, x, y)
        with poisoned(poison1), scale_loss(loss1, [o1, o2], loss_id=1) as s:
            s.backward()
        for o in (o1, o2) if order == "o1_first" else (o2, o1):
            o.step()
            o.zero_grad()
        moved1 = any(changed(a, b) for a, b in zip(snap1["params"], m1.parameters()))
        moved2 = any(changed(a, b) for a, b in zip(snap2["params"], m2.parameters()))
        if o1.step_skipped:
            assert_tree_bitwise(snapshot(m1, o1), snap1)
        if o2.step_skipped:
            assert_tree_bitwise(snapshot(m2, o2), snap2)
        assert moved1 != o1.step_skipped and moved2 != o2.step_skipped
        return (
            o1.step_skipped,
            o2.step_skipped,
            o1.slots[0].scaler.scale,
            o1.slots[1].scaler.scale,
        )

    assert iteration() == (False, False, 64, 64)
    # overflow in loss1's gradient of m2: o1 also received loss1 gradients, so both skip
    assert iteration(poison1=m2[0].weight) == (True, True, 128, 32)
    # overflow in loss1's gradient of m1 only: still both skip
    assert iteration(poison1=m1[3].weight) == (True, True, 128, 16)
    # overflow only in loss0 (touches m1 only): only o1 skips; loss1's scaler counts a clean step
    assert iteration(poison0=m1[0].bias) == (True, False, 64, 16)
    assert iteration() == (False, False, 64, 32)
    assert iteration() == (False, False, 128, 32)
    s0, s1 = o1.slots[0].scaler, o1.slots[1].scaler
    # each scaler is updated once per iteration although two optimizers step
    assert (s0.steps, s0.skipped_steps) == (6, 1)
    assert (s1.steps, s1.skipped_steps) == (6, 2)
    assert (o1.skipped_steps, o2.skipped_steps) == (3, 2)


# ------------------------------------------------------------------ 6. gradient clipping


@pytest.mark.parametrize(
    ("level", "dtype"), [("O1", BF16), ("O2", BF16), ("O1", FP16), ("O2", FP16), ("O3", BF16)]
)
def test_clip_grad_norm_matches_torch_on_unscaled_grads(level, dtype):
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, level, dtype)
    if dtype == FP16:
        assert opt.loss_scale == 2.0**16
    opt.backward(mse(model, x, y))
    grads = [m.grad.detach().float().clone() for m in opt.master_params()]
    masters_before = [m.detach().clone() for m in opt.master_params()]

    # reference: an fp32 model holding the same (16-bit, upcast) gradients
    ref = make_model()
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.clone()
    full = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
    max_norm = full / 3
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    norm = opt.clip_grad_norm_(max_norm)
    # fp32 masters: the same fp32 arithmetic as the reference. O3 (bf16 params, no masters):
    # torch computes the norm and the clipped grads in bf16 itself, within a few bf16 ulps.
    low = opt.master_params()[0].dtype != torch.float32
    assert low == (level == "O3")
    tol = dict(rtol=1e-2, atol=1e-4) if low else dict(rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(norm.float(), ref_norm, **tol)
    for m, r in zip(opt.master_params(), ref.parameters()):
        torch.testing.assert_close(m.grad.float(), r.grad, **tol)

    # the norm is the unscaled one: close to an fp32 model's own gradient norm (16-bit grads:
    # a few percent); a scaled norm would be 65536x off.
    fp32 = make_model()
    mse(fp32, x, y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in fp32.parameters()]).item()
    assert norm.item() == pytest.approx(true_norm, rel=3e-2)

    # the step uses the clipped gradients
    opt.step()
    assert not opt.step_skipped
    for m, m0, r in zip(opt.master_params(), masters_before, ref.parameters()):
        expected = (m0.float() - 0.1 * r.grad).to(m.dtype)
        torch.testing.assert_close(
            m,
            expected,
            rtol=1e-2 if m.dtype != torch.float32 else 1e-5,
            atol=1e-2 if m.dtype != torch.float32 else 1e-6,
        )


def test_clip_grad_norm_with_plain_backward():
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, "O2", BF16)
    mse(model, x, y).backward()  # no scale_loss
    raw = [p.grad.float().clone() for p in model.parameters()]
    norm = opt.clip_grad_norm_(1e9)
    assert norm.item() == pytest.approx(torch.nn.utils.get_total_norm(raw).item(), rel=1e-6)
    opt.step()
    assert not opt.step_skipped


# ------------------------------------------------------------------ 7. gradient accumulation


@pytest.mark.parametrize(("level", "dtype"), [("O0", None), ("O1", BF16), ("O2", BF16)])
def test_accumulation_matches_full_batch(level, dtype):
    x, y = batch(n=8)
    full = make_model()
    full_opt = torch.optim.SGD(full.parameters(), lr=0.1)
    full, full_opt = initialize(full, full_opt, level, dtype)
    full_opt.backward(mse(full, x, y))
    full_grads = [m.grad.clone() for m in full_opt.master_params()]
    full_opt.step()

    acc = make_model()
    acc_opt = torch.optim.SGD(acc.parameters(), lr=0.1)
    acc, acc_opt = initialize(acc, acc_opt, level, dtype)
    acc_opt.backward(mse(acc, x[:4], y[:4]) / 2)
    acc_opt.backward(mse(acc, x[4:], y[4:]) / 2)
    acc_grads = [m.grad.clone() for m in acc_opt.master_params()]
    acc_opt.step()
    # fp32: summation order only; 16-bit matmul outputs round to bf16 (2**-8 relative)
    tol = dict(rtol=1e-5, atol=1e-7) if level == "O0" else dict(rtol=2e-2, atol=2e-3)
    for a, f in zip(acc_grads, full_grads):
        torch.testing.assert_close(a, f, **tol)
    for a, f in zip(acc.parameters(), full.parameters()):
        torch.testing.assert_close(a.float(), f.float(), **tol)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp16_accumulated_grad_is_sum_of_unscaled_grads(level):
    x, y = batch(n=8)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe(level, FP16, loss_scale=LossScaling(init_scale=2.0**12))
    )
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]
    single = []
    for xb, yb in halves:
        opt.backward(mse(model, xb, yb) / 2)
        single.append([m.grad.clone() for m in opt.master_params()])
        opt.zero_grad()
    for xb, yb in halves:
        opt.backward(mse(model, xb, yb) / 2)
    for m, g0, g1 in zip(opt.master_params(), *single):
        # unscaling by 2**-12 is exact, so the accumulated grad is exactly g0 + g1
        assert_bitwise(m.grad, g0 + g1)
    # and it is the unscaled gradient: close to an fp32 model's full-batch gradient
    ref = make_model()
    mse(ref, x, y).backward()
    for m, r in zip(opt.master_params(), ref.parameters()):
        torch.testing.assert_close(m.grad.float(), r.grad, rtol=2e-2, atol=2e-3)
    opt.step()
    assert not opt.step_skipped and opt.slots[0].scaler.steps == 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulation_keeps_grads_the_second_backward_does_not_reach(level):
    """Stashed (already unscaled) grads of parameters the next loss does not touch survive."""
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe(level, FP16, loss_scale=LossScaling(init_scale=2.0**8))
    )
    opt.backward(mse(model, x, y))
    first = [m.grad.clone() for m in opt.master_params()]
    # touches only the LayerNorm weight and the last Linear's weight (gradient: ones)
    opt.backward(model[2].weight.float().sum() + model[3].weight.float().sum())
    names = [n for n, _ in model.named_parameters()]
    for name, m, g in zip(names, opt.master_params(), first):
        if name in ("2.weight", "3.weight"):
            assert_bitwise(m.grad, g + 1)
        else:
            assert m.grad is not None, name
            assert_bitwise(m.grad, g)
    opt.step()
    assert not opt.step_skipped


# ------------------------------------------------------------ 8. fused vs foreach AdamW


def test_fused_and_foreach_adamw_train_and_agree():
    x, y = batch(n=8)
    results = {}
    for impl in ("fused", "foreach"):
        model = make_model()
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
        model, opt = initialize(model, opt, "O2", BF16)
        assert opt.optimizer.defaults[impl] is True
        losses = []
        for _ in range(30):
            loss = mse(model, x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert all(not torch.isnan(torch.tensor(v)) for v in losses)
        assert losses[-1] < 0.5 * losses[0]
        results[impl] = (losses, [m.detach().clone() for m in opt.master_params()])
    (l_a, m_a), (l_b, m_b) = results["fused"], results["foreach"]
    # same math on fp32 masters; kernels differ in the last bits only
    assert l_a[-1] == pytest.approx(l_b[-1], rel=1e-3)
    for a, b in zip(m_a, m_b):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ 9. LR scheduler


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler_held_on_skipped_steps(kind):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe("O2", FP16, loss_scale=LossScaling(init_scale=2.0**8))
    )
    if kind == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    x, y = batch()
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for t in range(7):
            used.append(opt.param_groups[0]["lr"])
            with poisoned(model[0].weight if t in (2, 3) else None):
                opt.backward(mse(model, x, y))
            opt.step()
            opt.zero_grad()
            if not opt.step_skipped:
                sched.step()
    # epochs advance on the 5 real steps only
    if kind == "step":
        expected = [0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.025]
    else:
        expected = [0.1, 0.1 / 2, 0.1 / 3, 0.1 / 3, 0.1 / 3, 0.1 / 4, 0.1 / 5]
    assert used == pytest.approx(expected, rel=1e-12)
    assert sched.last_epoch == 5 and opt.skipped_steps == 2
    assert sched.get_last_lr() == pytest.approx([0.025 if kind == "step" else 0.1 / 6])
    assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# ------------------------------------------------------------------ 10. add_param_group


def test_add_param_group_creates_stepped_masters_at_o2():
    model = make_model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = initialize(model, opt, "O2", BF16)
    assert len(opt._pairs) == 2
    opt.add_param_group({"params": model[3].parameters(), "lr": 0.5})
    opt.add_param_group({"params": model[2].weight})  # fp32 norm param: its own master
    assert len(opt._pairs) == 4
    new = opt._pairs[2:]
    assert next(p for p, _ in new) is model[3].weight and new[1][0] is model[3].bias
    for p, m in new:
        assert m.dtype == torch.float32 and p.dtype == BF16
        assert_bitwise(m, p.float())
    assert all(a is b for a, b in zip(opt.param_groups[1]["params"], [m for _, m in new]))
    assert opt.param_groups[2]["params"][0] is model[2].weight
    assert opt.param_groups[2]["lr"] == 0.1  # defaults filled in by the inner optimizer

    x, y = batch()
    before = [m.detach().clone() for _, m in new]
    ln_before = model[2].weight.detach().clone()
    opt.backward(mse(model, x, y))
    grads = [m.grad.clone() for _, m in new]
    ln_grad = model[2].weight.grad.clone()
    opt.step()
    for (p, m), m0, g in zip(new, before, grads):
        torch.testing.assert_close(m, m0 - 0.5 * g, rtol=1e-6, atol=1e-7)
        assert_bitwise(p, m.to(BF16))  # the bf16 copy follows its master
    torch.testing.assert_close(
        model[2].weight.detach(), ln_before - 0.1 * ln_grad, rtol=1e-6, atol=1e-7
    )


# ------------------------------------------------------------------ 12. plain usage


@pytest.mark.parametrize(("level", "dtype"), [("O1", BF16), ("O2", BF16), ("O2", FP16)])
def test_plain_backward_and_step(level, dtype):
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, level, dtype)
    masters = opt.master_params()
    before = [m.detach().clone() for m in masters]
    mse(model, x, y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(m.grad.clone() for m in masters))
    opt.step()
    assert not opt.step_skipped
    for m, m0, g, mg in zip(masters, before, raw, seen):
        # the raw (unscaled) gradient reached the fp32 master unchanged, and SGD used it
        assert_bitwise(mg, g.float())
        if id(m) in opt._master_ids:
            assert m.grad is None  # a master's grad is used up: not added into the next step
        torch.testing.assert_close(m.detach(), m0 - 0.1 * g.float(), rtol=1e-6, atol=1e-7)
    for p, m in zip(model.parameters(), masters):
        assert_bitwise(p.detach(), m.detach().to(p.dtype))
    if dtype == FP16:
        assert opt.loss_scale == 2.0**16  # untouched: nothing was scaled

    opt.zero_grad()
    for p in model.parameters():
        snap = snapshot(model, opt)
        with poisoned(p, INF):
            mse(model, x, y).backward()
        opt.step()
        assert opt.step_skipped
        assert_tree_bitwise(snapshot(model, opt), snap)
        opt.zero_grad()
    assert opt.skipped_steps == 6


def test_zero_grad_set_to_none_false_then_accumulate():
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe("O2", FP16, loss_scale=LossScaling(init_scale=2.0**8))
    )
    opt.backward(mse(model, x, y))
    g = [m.grad.clone() for m in opt.master_params()]
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(m.grad) == 0 for m in opt.master_params())
    opt.backward(mse(model, x, y))
    for m, g0 in zip(opt.master_params(), g):
        assert torch.equal(m.grad, g0)  # 0 + g: equal values (a -0.0 may become +0.0)
    opt.step()
    assert not opt.step_skipped


def test_step_rejects_closure():
    model = make_model()
    model, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", BF16)
    with pytest.raises(NotImplementedError, match="does not take a closure"):
        opt.step(lambda: mse(model, *batch()))


def test_step_hooks_run_on_real_steps_only():
    model = make_model()
    model, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", FP16)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x, y = batch()
    opt.backward(mse(model, x, y))
    opt.step()
    with poisoned(model[0].weight):
        opt.backward(mse(model, x, y))
    opt.step()
    assert calls == ["pre", "post"]


def test_zero_grad_drops_the_overflow_verdict_with_the_grads():
    """A non-finite backward whose grads were zeroed must not skip the next (clean) step."""
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, "O2", FP16)
    with poisoned(model[0].weight):
        opt.backward(mse(model, x, y))
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(mse(model, x, y))
    opt.step()
    assert not opt.step_skipped and opt.skipped_steps == 0
    assert all(changed(a, b) for a, b in zip(before, model.parameters()))
    # the scale still reacts to the overflow that loss produced at that scale
    assert opt.loss_scale == 2.0**15


def test_loss_scaling_settings_give_each_loss_its_own_scaler():
    scaling = LossScaling(init_scale=16.0, growth_interval=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe("O2", FP16, loss_scale=scaling, num_losses=2)
    )
    assert opt.slots[0].scaler is not opt.slots[1].scaler
    x, y = batch()
    opt.backward(mse(model, x, y), loss_id=0)
    opt.backward(mse(model, x, y), loss_id=1)
    opt.step()
    # one clean step each: neither scaler has grown yet (growth_interval 2)
    for s in (opt.slots[0].scaler, opt.slots[1].scaler):
        assert (s.scale, s.steps, s.growth_tracker) == (16.0, 1, 1)


def test_scale_loss_rejects_optimizers_from_separate_initialize_calls():
    m1, m2 = make_model(0), make_model(1)
    m1, o1 = initialize(m1, torch.optim.SGD(m1.parameters(), lr=0.1), "O2", FP16)
    m2, o2 = initialize(
        m2,
        torch.optim.SGD(m2.parameters(), lr=0.1),
        mixprec.Recipe("O2", FP16, loss_scale=LossScaling(init_scale=2.0**4)),
    )
    x, y = batch()
    with pytest.raises(ValueError, match="optimizers from different initialize calls"):
        with scale_loss(mse(m1, x, y) + mse(m2, x, y), [o1, o2]) as s:
            s.backward()


@pytest.mark.parametrize("scaled_first", [True, False])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_plain_and_scaled_backward_mix_in_one_step(level, scaled_first):
    """A plain ``aux.backward()`` next to ``opt.backward(main)``: both reach every master once,
    the plain (unscaled) gradient is never divided by the loss scale, in either order."""
    x, y = batch()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(
        model, opt, mixprec.Recipe(level, FP16, loss_scale=LossScaling(init_scale=2.0**10))
    )

    def main_loss():
        return mse(model, x, y)

    def aux_loss():
        return sum(p.float().pow(2).sum() for p in model.parameters()) / 8

    opt.backward(main_loss())
    g_main = [m.grad.clone() for m in opt.master_params()]
    opt.zero_grad()
    aux_loss().backward()
    g_aux = [p.grad.float().clone() for p in model.parameters()]
    opt.zero_grad()

    if scaled_first:
        opt.backward(main_loss())
        aux_loss().backward()
    else:
        aux_loss().backward()
        opt.backward(main_loss())
    norm = opt.clip_grad_norm_(1e9)  # also takes in raw grads
    for m, a, b in zip(opt.master_params(), g_main, g_aux):
        assert_bitwise(m.grad, a + b)
    assert all(p.grad is None for p, _ in opt._pairs)
    expected = torch.nn.utils.get_total_norm([a + b for a, b in zip(g_main, g_aux)])
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    opt.step()
    assert not opt.step_skipped
    # a non-finite plain gradient in a 16-bit param still skips when mixed with scaled ones
    # (for fp32 params see the test below)
    if level == "O2":
        opt.zero_grad()
        if scaled_first:
            opt.backward(main_loss())
        with poisoned(model[3].weight):
            aux_loss().backward()
        if not scaled_first:
            opt.backward(main_loss())
        opt.step()
        assert opt.step_skipped


@pytest.mark.parametrize("scaled_first", [True, False])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_plain_inf_around_scaled_backward_into_fp32_param(level, scaled_first):
    x, y = batch()
    model = make_model()
    model, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, FP16)
    if scaled_first:
        opt.backward(mse(model, x, y))
    with poisoned(model[2].weight):  # LayerNorm weight: fp32 at O1 and O2
        # only the fp32 param: a plain loss reaching a 16-bit param triggers a full re-check
        model[2].weight.sum().backward()
    if not scaled_first:
        opt.backward(mse(model, x, y))
    opt.step()
    assert opt.step_skipped


def test_failed_backward_inside_scale_loss_keeps_accumulated_grads():
    x, y = batch()
    model = make_model()
    model, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", BF16)
    opt.backward(mse(model, x, y))
    before = [p.grad.clone() for p in opt.master_params()]
    with pytest.raises(RuntimeError, match="boom"), scale_loss(mse(model, x, y), opt):
        raise RuntimeError("boom")
    for p, g in zip(opt.master_params(), before):
        assert_bitwise(p.grad, g)


# ------------------------------------------------------------- skip counters agree


def _grad_of(opt, model_param):
    """The gradient the optimizer steps for ``model_param`` (its master's at O2)."""
    master = opt._model_to_master.get(model_param, model_param)
    return master.grad


@pytest.mark.parametrize(("level", "dtype"), [("O1", FP16), ("O2", FP16), ("O2", BF16)])
@pytest.mark.parametrize("when", ["after_backward", "after_clip"])
def test_an_inf_written_after_backward_skips_and_counts_everywhere(level, dtype, when):
    """A gradient made non-finite after the scaled backward (user code, a hook) skips the step:
    the loss scaler backs off and counts it like an overflow in the backward itself. (The
    scaler used to see only the backward's verdict: 4 skips, scaler.skipped_steps 0.)"""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, mixprec.Recipe(level, dtype, loss_scale="dynamic"))
    scaler = opt.slot(0).scaler
    x, y = batch()
    scales = [scaler.scale]
    for _ in range(4):
        opt.backward(mse(model, x, y))
        if when == "after_clip":
            opt.clip_grad_norm_(1.0)
        _grad_of(opt, model[0].weight).view(-1)[0] = INF
        before = snapshot(model, opt)
        opt.step()
        assert opt.step_skipped and scaler.last_step_skipped
        assert_tree_bitwise(before, snapshot(model, opt))
        opt.zero_grad()
        scales.append(scaler.scale)
    assert opt.skipped_steps == scaler.skipped_steps == scaler.steps == 4
    assert scales == [scales[0] / 2**k for k in range(5)]
    opt.backward(mse(model, x, y))  # and a clean step counts as one
    opt.step()
    assert not opt.step_skipped and (scaler.steps, scaler.skipped_steps) == (5, 4)


def test_a_late_inf_counts_against_every_loss_that_fed_the_step_and_only_those():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, mixprec.Recipe("O1", FP16, num_losses=3))
    x, y = batch()
    opt.backward(mse(model, x, y), loss_id=0)
    opt.backward(mse(model, x, y) * 0.5, loss_id=1)
    model[3].weight.grad.view(-1)[1] = NAN
    opt.step()
    counts = [(s.scaler.steps, s.scaler.skipped_steps) for s in opt.slots]
    assert opt.step_skipped and opt.skipped_steps == 1
    assert counts == [(1, 1), (1, 1), (0, 0)]  # loss 2 did not take part in this step


def test_an_overflow_in_one_loss_backs_off_that_loss_only():
    """Per-loss scalers (Apex's num_losses): the optimizer skips, each scaler judges its loss."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, mixprec.Recipe("O1", FP16, num_losses=2))
    x, y = batch()
    opt.backward(mse(model, x, y), loss_id=0)
    with poisoned(model[0].bias):
        opt.backward(mse(model, x, y), loss_id=1)
    opt.step()
    assert opt.step_skipped and opt.skipped_steps == 1
    assert [(s.scaler.steps, s.scaler.skipped_steps) for s in opt.slots] == [(1, 0), (1, 1)]


def test_a_plain_backward_with_no_scaled_loss_leaves_the_scaler_alone():
    """No loss was scaled for this step: the optimizer skips it, no scaler took part."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, "O1", FP16)
    x, y = batch()
    with poisoned(model[0].weight):
        mse(model, x, y).backward()
    opt.step()
    scaler = opt.slot(0).scaler
    assert opt.step_skipped and opt.skipped_steps == 1
    assert (scaler.steps, scaler.skipped_steps) == (0, 0)


def test_a_plain_backward_under_loss_scaling_warns_once_with_the_fix():
    """`loss.backward()` where `opt.backward(loss)` was meant: with fp16 loss scaling on, small
    losses' 16-bit gradients underflow to zero (100 % of a first layer's, measured), silently."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, "O2", FP16)
    x, y = batch()
    mse(model, x, y).backward()
    with pytest.warns(UserWarning, match=r"without loss scaling.*opt.backward\(loss\)") as rec:
        opt.step()
    assert rec[0].filename == __file__  # points at the user's step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mse(model, x, y).backward()  # once per optimizer
        opt.step()
        opt.zero_grad()
        opt.backward(mse(model, x, y))  # the right call never warns
        opt.step()


def test_a_plain_backward_without_loss_scaling_does_not_warn():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, "O2", BF16)  # bf16: no scaling
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mse(model, x, y).backward()
        opt.step()
    assert not opt.step_skipped


@pytest.mark.parametrize(
    ("level", "dtype"), [("O0", None), ("O1", FP16), ("O2", FP16), ("O3", BF16)]
)
def test_grad_of_gives_every_parameter_its_unscaled_gradient_at_every_level(level, dtype):
    """At O2 `p.grad` is None after backward (the gradient lives on the fp32 master): per-layer
    gradient-norm logging crashed or silently logged only the norm layers."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = initialize(model, opt, level, dtype)
    x, y = batch()
    opt.backward(mse(model, x, y))
    mse(ref, x, y).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = opt.grad_of(p)
        assert g is not None, name
        assert g.dtype == (torch.float32 if level in ("O0", "O1", "O2") else p.dtype), name
        tol = 0 if level == "O0" else 0.1  # unscaled: the fp32 gradient within 16-bit error
        assert torch.allclose(g.float(), r.grad, rtol=tol, atol=tol * r.grad.abs().max()), name
    if level == "O2":
        assert model[0].weight.grad is None  # where the usual idiom looked


def test_fresh_flat_master_grads_where_the_allocator_caches_are_bitwise_the_kept_buffers(
    monkeypatch,
):
    """On CUDA no fp32 master-grad buffer is held through the forward; the values match."""
    from mixprec._core.optimizer import MixedPrecisionOptimizer

    runs = []
    for keep in (True, False):
        monkeypatch.setattr(
            MixedPrecisionOptimizer, "keep_grad_buffers", staticmethod(lambda d, k=keep: k)
        )
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = initialize(model, opt, "O2", torch.bfloat16)
        x, y = batch()
        for accumulate in (1, 2, 1):
            for _ in range(accumulate):
                opt.backward(mse(model, x, y))
            masters = [m for _, m in opt._pairs]
            if not keep:  # the step's master grads are views of one flat buffer
                bases = {m.grad.untyped_storage().data_ptr() for m in masters}
                assert len(bases) == 1 and not opt._grad_buffers
            opt.step()
            opt.zero_grad()
            assert all(m.grad is None for m in masters)
            assert bool(opt._grad_buffers) == keep  # kept through the next forward, or not
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
