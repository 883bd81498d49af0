"""A checkpoint saved under one recipe resumes under another: each state carried by its rule
(mixprec._core.recipe_change), the change reported, and training goes on."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core.update.state_codes import QuantizedState

BF16 = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 4))


def _data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def _train(model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _saved(recipe: str):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, recipe, BF16)
    _train(model, opt, _data(4))
    return model, opt, model.state_dict(), opt.state_dict()


def _resumed(recipe: str, model_sd, opt_sd, *, before_initialize: bool = False):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if before_initialize:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = mixprec.initialize(model, opt, recipe, BF16)
        if not before_initialize:
            model.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
    return model, opt, [str(w.message) for w in caught]


PAIRS = [("O2", "O3"), ("O2", "lean"), ("O3", "lean"), ("lean", "O2"), ("O3", "O2"), ("lean", "O3")]


@pytest.mark.parametrize("before", [False, True], ids=["after-initialize", "before-initialize"])
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resumes_under_another_recipe_and_trains_on(src, dst, before):
    _, _, model_sd, opt_sd = _saved(src)
    model, opt, said = _resumed(dst, model_sd, opt_sd, before_initialize=before)
    assert opt.last_load_report, "the change is reported"
    assert any("another recipe" in m for m in said), said
    losses = _train(model, opt, _data(1) * 8)  # one batch again: its loss falls
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert opt.recipe.level == mixprec.Recipe(dst).level


def test_masters_become_weights_and_kahan_compensation():
    _, src_opt, model_sd, opt_sd = _saved("O2")
    masters = [m.detach().clone() for _, m in src_opt._pairs]
    ids = {id(m) for _, m in src_opt._pairs}
    at = [
        i
        for i, q in enumerate(q for g in src_opt.param_groups for q in g["params"])
        if id(q) in ids
    ]
    _, opt, _ = _resumed("O3", model_sd, opt_sd)
    params = [p for g in opt.param_groups for p in g["params"]]
    low = [params[i] for i in at]
    assert len(low) == len(masters) == 4 and all(p.dtype == BF16 for p in low)
    for p, m in zip(low, masters):
        assert torch.equal(p, m.to(BF16)), "the weight is its master rounded to nearest"
        comp = opt.updater.compensation[p]
        rest = m - p.float()
        assert torch.equal(comp, rest.to(comp.dtype)), "the compensation is the remainder"
        # weight + compensation is the master within the compensation's own rounding
        assert ((p.float() + comp.float() - m).abs() <= rest.abs() * 2.0**-7).all()


def test_weights_and_compensation_become_masters_exactly():
    _, src_opt, model_sd, opt_sd = _saved("O3")
    src = [p for g in src_opt.param_groups for p in g["params"]]
    _, opt, _ = _resumed("O2", model_sd, opt_sd)
    ids = {id(m) for _, m in opt._pairs}
    at = [i for i, q in enumerate(q for g in opt.param_groups for q in g["params"]) if id(q) in ids]
    want = [src[i].detach().float() + src_opt.updater.compensation[src[i]].float() for i in at]
    assert len(opt._pairs) == len(want) == 4
    for (p, m), w in zip(opt._pairs, want):
        assert torch.equal(m, w)
        assert torch.equal(p, w.to(p.dtype))


def test_codes_become_fp32_states_where_masters_step():
    _, _, model_sd, opt_sd = _saved("lean")
    coded = [
        (i, k, QuantizedState.from_dict(v).dequantize())
        for i, st in opt_sd["state"].items()
        for k, v in st.items()
        if QuantizedState.is_dict(v)
    ]
    assert coded, "lean's default holds some states as codes"
    _, opt, _ = _resumed("O2", model_sd, opt_sd)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, k, value in coded:
        got = opt.state[params[i]][k]
        assert got.dtype == torch.float32
        assert torch.equal(got, value)
    assert any(line.startswith(("exp_avg", "momentum")) for line in opt.last_load_report)


def test_same_recipe_reports_nothing():
    _, _, model_sd, opt_sd = _saved("lean")
    _, opt, said = _resumed("lean", model_sd, opt_sd)
    assert opt.last_load_report == []
    assert not any("another recipe" in m for m in said)


def test_another_model_is_still_refused():
    _, _, _, opt_sd = _saved("O2")
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    _, opt = mixprec.initialize(other, torch.optim.AdamW(other.parameters()), "lean", BF16)
    with pytest.raises((ValueError, KeyError)):
        opt.load_state_dict(opt_sd)


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_either_load_order_gives_the_same_state(src, dst):
    """The optimizer loaded before the model (after initialize) ends where the model-first
    order does: w + c into a master, or folded into a weight, waits for the model's weight."""
    _, _, model_sd, opt_sd = _saved(src)
    states = []
    for optimizer_first in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = mixprec.initialize(model, opt, dst, BF16)
            pairs = [(model, model_sd), (opt, opt_sd)]
            for target, sd in reversed(pairs) if optimizer_first else pairs:
                target.load_state_dict(sd)
        states.append(
            (mixprec.fp32_state_dict(model, opt), [p.detach().clone() for p in model.parameters()])
        )
    (fp32_a, low_a), (fp32_b, low_b) = states
    assert all(torch.equal(fp32_a[k], fp32_b[k]) for k in fp32_a)
    assert all(torch.equal(a, b) for a, b in zip(low_a, low_b))


def test_a_weight_without_a_saved_master_keeps_the_remainder_its_load_gave():
    """O2 keeps LayerNorm in fp32 (no master); under O3 its fp32 value loads as a bf16 weight
    plus the Kahan remainder, which the optimizer's load that follows keeps."""
    _, _, model_sd, opt_sd = _saved("O2")
    model, opt, _ = _resumed("O3", model_sd, opt_sd)
    ref = model_sd["2.weight"].float()
    remainder = ref - ref.to(BF16).float()
    assert remainder.abs().max() > 0
    err = mixprec.fp32_state_dict(model, opt)["2.weight"] - ref  # the remainder, in bf16
    assert err.abs().max() <= remainder.abs().max() * 2**-8


@pytest.mark.parametrize(("src", "dst"), [(torch.float16, BF16), (BF16, torch.float16)])
def test_each_dtype_keeps_its_own_loss_scaling(src, dst):
    """fp16's dynamic loss scale does not follow its checkpoint into bf16 (which scales
    nothing), nor does bf16's disabled scaler into fp16; the report says which was kept."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, "O2", src)
    _train(model, opt, _data(3))
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, "O3", dst)
    own = opt.slots[0].scaler.state_dict()
    model.load_state_dict(model_sd)
    with pytest.warns(mixprec.warnings.MixprecWarning, match="loss scale: saved"):
        opt.load_state_dict(opt_sd)
    assert opt.slots[0].scaler.state_dict() == own
    assert opt.slots[0].scaler.enabled == (dst == torch.float16)
    losses = _train(model, opt, _data(1) * 6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
