"""MixedPrecisionOptimizer.state_dict is torch's layout: it loads into the torch optimizer it
wraps (and into a plain one for the fp32 model), mixprec's own state rides in
param_groups[0]["mixprec"] (which a plain load keeps), and resumes stay bit-exact -- also from
the older mixprec layouts and from plain torch dicts."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from training_helpers import assert_bitwise, assert_tree_bitwise, make_model, mse, poisoned

import mixprec
from mixprec import fp32_state_dict, initialize
from mixprec._core.resume import split_state_dict

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16 = torch.bfloat16, torch.float16
LEVELS = [("O0", None), ("O1", FP16), ("O2", FP16), ("O3", FP16), ("O2", BF16)]
_g = torch.Generator().manual_seed(7)
DATA = [(torch.randn(8, 8, generator=_g), torch.randn(8, 4, generator=_g)) for _ in range(8)]


def build(level, dtype, **kw):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    scaling = mixprec.LossScaling(init_scale=2.0**4, growth_interval=2)
    return initialize(model, opt, mixprec.Recipe(level, dtype, loss_scale=scaling, **kw))


def train(model, opt, steps, poison=()):
    for t in steps:
        x, y = DATA[t]
        with poisoned(model[0].weight if t in poison else None):
            opt.backward(mse(model, x, y))
        opt.step()
        opt.zero_grad()


def saved(obj):
    """Through torch.save / torch.load(weights_only=True), as a real checkpoint."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_state_dict_is_torch_layout_and_loads_into_the_wrapped_optimizer(level, dtype):
    model, opt = build(level, dtype)
    train(model, opt, range(4), poison={1})
    sd = saved(opt.state_dict())
    assert set(sd) == {"state", "param_groups"}
    inner = opt.optimizer.state_dict()
    assert_tree_bitwise(split_state_dict(sd)[0], inner)
    extra = sd["param_groups"][0]["mixprec"]
    assert all("mixprec" not in g for g in sd["param_groups"][1:])
    assert extra["skipped_steps"] == 1 and extra["step_skipped"] is False
    assert len(extra["scalers"]) == 1 and extra["scalers"][0]["scale"] == 2.0**4
    for (_, master), value in zip(opt._pairs, extra["masters"], strict=True):
        assert_bitwise(value, master.detach())
    # the torch optimizer it wraps takes it as it is, and so does a plain torch optimizer over
    # a plain fp32 copy of the model, keeping the entry in its group (as it keeps any group
    # key); torch casts each state tensor to its parameter's dtype (O3's fp32 second moments
    # become fp16 in the former)
    plain = make_model(seed=1)
    plain.load_state_dict(fp32_state_dict(model, opt))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.5, eps=1e-4)
    for torch_opt in (opt.optimizer, plain_opt):
        torch_opt.load_state_dict(sd)
        assert torch_opt.param_groups[0]["lr"] == 1e-2
        assert_tree_bitwise(torch_opt.param_groups[0]["mixprec"], extra)
        loaded = torch_opt.state_dict()["state"]
        assert set(loaded) == set(inner["state"])
        for i, st in loaded.items():
            assert set(st) == set(inner["state"][i])
            for key, value in st.items():
                assert_bitwise(value, inner["state"][i][key].to(value.dtype))


def test_plain_torch_optimizer_continues_an_o0_run_bit_for_bit():
    """Hand the O0 state to plain torch (a trainer or tool that knows only torch's layout):
    it continues exactly as the mixprec run does (O0: fp32, power-of-two scaling is exact)."""
    model, opt = build("O0", None)
    train(model, opt, range(3))
    sd = saved({"model": model.state_dict(), "opt": opt.state_dict()})
    plain = make_model(seed=1)
    plain.load_state_dict(sd["model"])
    plain_opt = torch.optim.AdamW(plain.parameters())
    plain_opt.load_state_dict(sd["opt"])
    train(model, opt, range(3, 8))
    for t in range(3, 8):
        x, y = DATA[t]
        mse(plain, x, y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert_bitwise(a.detach(), b.detach())


@pytest.mark.parametrize(("level", "dtype"), LEVELS)
def test_a_layout_mixprec_does_not_write_is_refused_and_changes_nothing(level, dtype):
    model, opt = build(level, dtype)
    train(model, opt, range(4), poison={1})
    inner, own = split_state_dict(opt.state_dict())
    before = saved(opt.state_dict())
    # the inner dict under "optimizer" with the rest flat; mixprec's entry at the top level
    for layout in ({"optimizer": inner, **own}, {**inner, "mixprec": own}):
        with pytest.raises(KeyError, match=r"param_groups\[0\]\['mixprec'\]"):
            opt.load_state_dict(saved(layout))
        assert_tree_bitwise(opt.state_dict(), before)


def test_masters_survive_the_round_trip_exactly_at_o2():
    model, opt = build("O2", FP16)
    train(model, opt, range(4))
    masters = [m.detach().clone() for _, m in opt._pairs]
    assert any(not torch.equal(m, p.detach().float()) for (p, _), m in zip(opt._pairs, masters))
    sd = saved(opt.state_dict())
    _, opt2 = build("O2", FP16)
    opt2.load_state_dict(sd)  # the optimizer alone: masters and the 16-bit weights follow
    for (p, m), want in zip(opt2._pairs, masters, strict=True):
        assert_bitwise(m.detach(), want)
        assert_bitwise(p.detach(), want.to(FP16))


def test_a_plain_torch_state_dict_loads_and_keeps_masters_and_scalers():
    """A checkpoint written by a plain torch optimizer (e.g. an fp32 run being moved to O2):
    state and hyper-parameters load; masters follow the model, loss scalers keep their state."""
    model, opt = build("O2", FP16)
    train(model, opt, range(3), poison={1})
    masters = [m.detach().clone() for _, m in opt._pairs]
    scaler = copy.deepcopy(opt.slots[0].scaler.state_dict())
    plain = make_model(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, eps=1e-4)
    mse(plain, *DATA[0]).backward()
    plain_opt.step()
    opt.load_state_dict(saved(plain_opt.state_dict()))
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.skipped_steps == 1
    assert opt.slots[0].scaler.state_dict() == scaler
    for (_, m), want in zip(opt._pairs, masters):
        assert_bitwise(m.detach(), want)
    first = opt.master_params()[0]
    assert opt.state[first]["exp_avg"].dtype == torch.float32  # cast to the master's dtype
    assert_bitwise(opt.state[first]["exp_avg"], plain_opt.state[plain[0].weight]["exp_avg"])
    train(model, opt, range(3, 5))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_load_state_dict_rejects_what_is_not_an_optimizer_state_dict():
    _, opt = build("O2", FP16)
    with pytest.raises(KeyError, match=r"received keys \['model', 'step'\]"):
        opt.load_state_dict({"model": {}, "step": 3})
    sd = opt.state_dict()
    del sd["param_groups"][0]["mixprec"]["scalers"]
    with pytest.raises(KeyError, match=r"'mixprec' entry misses \['scalers'\]"):
        opt.load_state_dict(sd)
