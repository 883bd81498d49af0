"""mixprec.compat.apex: both of Apex's restore orders resume bit-exact at O0-O3, optimizer
wrappers (LARC) work at every level, and O1 outputs keep the model's own dtype as in Apex."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise

import mixprec
from mixprec.compat import apex as mp_apex
from mixprec.compat.apex import amp
from mixprec.compat.larc import LARC

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FP16, FP32 = torch.float16, torch.float32
LEVELS = ["O0", "O1", "O2", "O3"]


@pytest.fixture(autouse=True)
def _clean_amp():
    amp.reset()
    yield
    amp.reset()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _fresh(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model, opt, steps):
    outs = []
    for t in steps:
        x, y = _batch(t)
        out = model(x)
        opt.zero_grad()
        with amp.scale_loss((out.float() - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        outs.append(out.detach())
    return outs


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("order", ["load_then_initialize", "initialize_then_load"])
@pytest.mark.parametrize("level", LEVELS)
def test_apex_restore_orders_resume_bit_exact(level, order):
    """Apex documents ``amp.initialize`` first, then the loads; its checkpointing test also
    restores into a fresh, plain model and optimizer and initializes afterwards."""
    model, opt = amp.initialize(*_fresh(), opt_level=level, verbosity=0)
    _train(model, opt, range(3))
    ckpt = _saved({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    assert all(v.dtype != FP16 for v in ckpt["model"].values())
    plain_model, plain_opt = _fresh(seed=1)  # other initial weights: all must come from ckpt
    if order == "load_then_initialize":
        plain_model.load_state_dict(ckpt["model"])
        plain_opt.load_state_dict(ckpt["opt"])  # torch's layout: a plain torch optimizer loads it
        assert plain_opt.state  # momentum buffers, keyed by the plain model's parameters
        model2, opt2 = amp.initialize(plain_model, plain_opt, opt_level=level, verbosity=0)
    else:
        model2, opt2 = amp.initialize(plain_model, plain_opt, opt_level=level, verbosity=0)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    for (p, m), (p2, m2) in zip(
        zip(opt.model_params(), opt.master_params()), zip(opt2.model_params(), opt2.master_params())
    ):
        assert_bitwise(p2.detach(), p.detach())
        assert_bitwise(m2.detach(), m.detach())  # O2: the exact fp32 masters, in both orders
    for a, b in zip(_train(model, opt, range(3, 6)), _train(model2, opt2, range(3, 6))):
        assert_bitwise(a, b)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k == k2
        assert_bitwise(v, v2)
    assert opt.loss_scale == opt2.loss_scale


def test_initialize_gives_the_optimizer_its_state_back_when_it_fails():
    model, opt = _fresh()
    x, y = _batch(0)
    (model(x) - y).pow(2).mean().backward()
    opt.step()  # momentum buffers: the state a loaded checkpoint would hold
    before = {p: s["momentum_buffer"].clone() for p, s in opt.state.items()}
    with pytest.raises(ValueError, match="none of the given models own"):
        amp.initialize(nn.Linear(2, 2), opt, opt_level="O2", verbosity=0)
    assert set(opt.state) == set(before)
    for p, s in opt.state.items():
        assert_bitwise(s["momentum_buffer"], before[p])


# -- optimizer wrappers -----------------------------------------------------------------------
class Scaled:
    """The smallest optimizer wrapper Apex accepted: param_groups, state and step, nothing of
    torch.optim.Optimizer. It halves every gradient, records the dtypes it saw, then steps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.seen: list[torch.dtype] = []

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.seen.append(p.dtype)
                    p.grad.mul_(0.5)
        self.optimizer.step()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight0 = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.weight1 = nn.Parameter(torch.tensor([0.5, 1.5]))

    def forward(self, x):
        return (x * self.weight0 * self.weight1).sum()


@pytest.mark.parametrize("level", LEVELS)
def test_optimizer_wrapper_works_at_every_level(level):
    torch.manual_seed(0)
    model, ref = Tiny(), Tiny()
    wrapper = Scaled(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.125))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.125, momentum=0.125)  # halved grads
    model, opt = amp.initialize(model, wrapper, opt_level=level, loss_scale=128.0, verbosity=0)
    x = torch.ones(2)
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(x), wrapper) as scaled:  # the wrapper itself: it maps to opt
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    want = FP32 if level in ("O0", "O1", "O2") else FP16  # O2: the wrapper steps fp32 masters
    assert wrapper.seen == [want] * 6
    tol = dict(rtol=0, atol=0) if level in ("O0", "O1") else dict(rtol=2e-3, atol=2e-3)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), r, **tol)
    sd = opt.state_dict()  # the wrapped optimizer's layout, mixprec's state in its first group
    assert {"state", "param_groups"} <= set(sd) and "mixprec" in sd["param_groups"][0]
    with pytest.raises(TypeError, match=r"wrappers that expose param_groups, state, step.*no step"):
        amp.initialize(nn.Linear(2, 2), type("NoStep", (), {"param_groups": [], "state": {}})())


@pytest.mark.parametrize("level", LEVELS)
def test_larc_matches_its_rule_at_every_level(level):
    """One step of the shim's LARC against the rule written out (trust 0.02, clip, weight
    decay folded into the gradient); the shim's apex.parallel.LARC is this class."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    w0 = lin.weight.detach().clone()
    opt = LARC(torch.optim.SGD(lin.parameters(), lr=0.1, weight_decay=1e-2))
    model, opt = amp.initialize(lin, opt, opt_level=level, loss_scale=1.0, verbosity=0)
    x = torch.randn(8, 8)
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    grad = opt.master_params()[0].grad.clone()
    opt.step()
    master = opt.master_params()[0].detach()
    start = w0 if master.dtype == FP32 else w0.to(master.dtype)
    w, g = start.float(), grad.float()
    local = 0.02 * w.norm() / (g.norm() + 1e-2 * w.norm() + 1e-8)
    local = torch.clamp(local / 0.1, max=1.0)
    want = w - 0.1 * (g + 1e-2 * w) * local
    tol = 1e-6 if master.dtype == FP32 else 2e-3
    torch.testing.assert_close(master.float(), want, rtol=tol, atol=tol)
    assert opt.param_groups[0]["weight_decay"] == 1e-2  # put back after the step
    mp_apex.install()
    try:
        from apex.parallel.LARC import LARC as ApexLARC

        assert ApexLARC is LARC and sys.modules["apex.parallel"].LARC is LARC
    finally:
        mp_apex.uninstall()


# -- O1 output dtype ---------------------------------------------------------------------------
def test_o1_outputs_keep_the_model_dtype_and_the_loss_runs_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = amp.initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), verbosity=0)
    out = model(x)
    assert out.dtype == FP16  # Apex: the final Linear's fp16, cast_model_outputs=None
    assert out.mean().dtype == FP32  # and, as Apex's patched torch, the loss runs in fp32
    assert nn.functional.mse_loss(out, torch.zeros(4, 2)).dtype == FP32
    amp._amp_state.handle._deactivate()
    forced = amp.initialize(nn.Linear(8, 2), opt_level="O1", cast_model_outputs=FP32, verbosity=0)
    assert forced(x).dtype == FP32
    amp.reset()
    o2 = amp.initialize(nn.Linear(8, 2), opt_level="O2", verbosity=0)
    assert o2(x).dtype == FP32  # O2/O3 outputs are fp32, as in Apex
    native = mixprec.initialize(nn.Linear(8, 2), None, "O1", FP16)
    assert native(x).dtype == FP32  # mixprec's own initialize keeps float32 outputs
    assert not mixprec._core.engine.is_active()  # and opens no region beyond the forward


def test_amp_state_exposes_apex_fields():
    model, opt = _fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    state = amp._amp_state
    assert state.opt_properties.loss_scale == "dynamic" and state.opt_properties.opt_level == "O2"
    assert state.opt_properties.master_weights is True and state.handle is None  # O1 only
    assert [s.loss_scale() for s in state.loss_scalers] == [2.0**16, 2.0**16]
    state.loss_scalers[1]._loss_scale = 16.0
    assert opt.slot(1).scaler.scale == 16.0 and amp.state_dict()["loss_scaler1"]["loss_scale"] == 16
