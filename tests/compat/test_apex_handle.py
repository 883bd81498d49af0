"""mixprec.compat.apex: Apex's older handle API, ``handle = amp.init()``, on a mixprec region and
mixprec's loss scaling -- casts, scaled losses, skipped steps, several losses per optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training_helpers import assert_bitwise, poisoned

import mixprec
from mixprec.compat.apex import amp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FP16, FP32 = torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _clean_amp():
    amp.reset()
    yield
    amp.reset()


def _data(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_init_casts_every_op_until_deactivated():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    handle = amp.init()
    assert handle.is_active() and amp._amp_state.handle is handle
    y = lin(x)  # no model boundary: the region itself casts, as Apex's patched functions did
    assert y.dtype == FP16
    assert F.softmax(y, dim=1).dtype == FP32 and y.sum().dtype == FP32
    y.float().sum().backward()  # backward inside the region: grads keep the leaves' dtypes
    assert lin.weight.grad.dtype == FP32
    with handle._disable_casts():
        assert not handle.is_active() and lin(x).dtype == FP32
    with amp.disable_casts():
        assert lin(x).dtype == FP32
    assert lin(x).dtype == FP16
    handle._deactivate()
    handle._deactivate()  # a second call does nothing
    assert not handle.is_active() and lin(x).dtype == FP32
    assert not mixprec._core.engine.is_active()


def test_handles_nest_and_refuse_out_of_order_deactivation():
    outer = amp.init()
    inner = amp.init(dtype=torch.bfloat16)
    assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="deactivated out of order"):
        outer._deactivate()
    inner._deactivate()
    assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == FP16
    outer._deactivate()
    assert not mixprec._core.engine.is_active()


def test_disabled_init_is_a_no_op():
    handle = amp.init(enabled=False)
    lin = nn.Linear(8, 4)
    assert lin(torch.randn(2, 8)).dtype == FP32 and not handle.is_active()
    loss = lin(torch.randn(2, 8)).pow(2).mean()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    wrapped = handle.wrap_optimizer(opt)
    with wrapped.scale_loss(loss) as scaled:
        assert scaled is loss


def _reference_step(ref, ref_opt, x, y, scale, poison=False):
    """What the handle must do, written out: forward in a float16 region, scaled backward,
    unscale, step unless a gradient is inf/NaN."""
    with mixprec.autocast(FP16):
        out = ref(x)
    with poisoned(ref[0].weight if poison else None):
        ((out.float() - y).pow(2).mean() * scale).backward()
    grads = [p.grad for p in ref.parameters()]
    if not all(torch.isfinite(g).all() for g in grads):
        ref_opt.zero_grad()
        return True
    for g in grads:
        g.mul_(1.0 / scale)
    ref_opt.step()
    ref_opt.zero_grad()
    return False


def test_handle_scale_loss_trains_like_the_written_out_loop_and_skips_overflows(capsys):
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    handle = amp.init()
    scale, losses = 2.0**16, []
    for t in range(6):
        x, y = _data(t)
        out = model(x)
        assert out.dtype == FP16
        loss = (out.float() - y).pow(2).mean()
        losses.append(float(loss))
        before = [p.detach().clone() for p in model.parameters()]
        with poisoned(model[0].weight if t == 2 else None):
            with handle.scale_loss(loss, opt) as scaled:
                assert float(scaled) == float(loss) * scale
                scaled.backward()
        assert "step" in opt.__dict__  # the next step goes through mixprec, once
        opt.step()
        assert "step" not in opt.__dict__
        opt.zero_grad()
        skipped = _reference_step(ref, ref_opt, x, y, scale, poison=t == 2)
        assert skipped == (t == 2)
        if skipped:
            assert "Gradient overflow, skipping update" in capsys.readouterr().out
            for a, b in zip(before, model.parameters()):
                assert_bitwise(a, b.detach())
            scale /= 2
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_bitwise(a.detach(), b.detach())
    handle._deactivate()
    assert losses[-1] < losses[0]


def test_handle_clears_cached_weight_casts_after_each_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    handle = amp.init()
    x, y = _data(0)
    first = model(x)
    with handle.scale_loss((first.float() - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    with torch.no_grad():
        fresh = [p.detach().half() for p in model.parameters()]
        want = F.linear(F.relu(F.linear(x.half(), fresh[0], fresh[1])), fresh[2], fresh[3])
        assert_bitwise(model(x), want)  # the updated weights, not the cached casts
    handle._deactivate()


def test_accumulating_two_scaled_backwards_before_a_step():
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = amp.init()
    x, y = _data(1)
    for part in (slice(0, 4), slice(4, 8)):
        loss = (model(x[part]).float() - y[part]).pow(2).mean()
        with handle.scale_loss(loss, opt) as scaled:
            scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    handle._deactivate()
    for part in (slice(0, 4), slice(4, 8)):
        with mixprec.autocast(FP16):
            out = ref(x[part])
        (out.float() - y[part]).pow(2).mean().backward()
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)  # unscaling is exact (2**16)


def test_wrap_optimizer_keeps_one_scaler_per_loss():
    model = _model()
    handle = amp.init()
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    with pytest.raises(RuntimeError, match="use `optimizer.scale_loss"):
        with handle.scale_loss(torch.ones((), requires_grad=True), opt._optimizer):
            pass
    x, y = _data(2)
    for t in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        out = model(x)
        first = (out[:, :2].float() - y[:, :2]).pow(2).mean()
        second = (out[:, 2:].float() - y[:, 2:]).pow(2).mean()
        with opt.scale_loss(first) as scaled:
            scaled.backward(retain_graph=True)
        with poisoned(model[2].weight if t == 1 else None), opt.scale_loss(second) as scaled:
            scaled.backward()
        if t == 1:
            with pytest.raises(RuntimeError, match="num_loss=2"):
                with opt.scale_loss(second):
                    pass
        opt.step()
        opt.zero_grad()
        assert opt.step_skipped == (t == 1)
        unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        assert unchanged == (t == 1)
    assert (opt.loss_scale(0), opt.loss_scale(1)) == (2.0**16, 2.0**15)
    sd = opt.state_dict()  # torch's layout: the plain optimizer takes it
    plain = torch.optim.SGD(_model().parameters(), lr=0.7)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["lr"] == 0.1
    scalers = sd["param_groups"][0]["mixprec"]["scalers"]
    assert [s["scale"] for s in scalers] == [2.0**16, 2.0**15]
    assert opt.param_groups is opt._optimizer.param_groups  # other attributes: the optimizer's
    handle._deactivate()
