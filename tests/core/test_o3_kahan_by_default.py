"""O3's default update: ``"kahan"`` in bf16 (any dense optimizer), unchanged in fp16.

Covers what initialize builds with SGD and Adam, that ``update=None`` is still the optimizer's
own bf16 step bit for bit, the optimizers that keep None (sparse gradients), ``state_dtype``
without ``update``, the compensation starting from the fp32 values the model held, resuming an
``update=None`` checkpoint under the default and refusing the reverse, a small-update run where
the old default stalls and the new one tracks fp32, and the accuracy benchmark's code path.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise, batch, make_model, mse, train

import mixprec
from mixprec import initialize

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def build(opt_fn, dtype=BF16, seed=0, **kw):
    model = make_model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return initialize(model, opt_fn(model.parameters()), mixprec.Recipe("O3", dtype, **kw))


# ------------------------------------------------- what initialize builds


@pytest.mark.parametrize("opt_fn", [sgd, adam, adamw], ids=["sgd", "adam", "adamw"])
def test_o3_bf16_defaults_to_kahan_with_auto_state(opt_fn):
    model, opt = build(opt_fn)
    assert opt.updater is not None and opt.updater.update == "kahan"
    auto = {"exp_avg": BF16, "momentum_buffer": BF16}  # "auto", resolved: first moments
    states = dict(opt.updater.plan.optimizer_states)
    assert states == auto and opt.master_params() == list(model.parameters())
    losses = train(model, opt, 20)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.6 * losses[0]
    for p in model.parameters():
        assert p.dtype == BF16 and p.grad is None
        assert opt.updater.compensation[p].dtype == BF16
        st = opt.state[p]
        if opt_fn is sgd:
            assert st["momentum_buffer"].dtype == BF16
        else:  # first moment bf16, second fp32: a bf16 v never decays with beta2 = 0.999
            assert st["exp_avg"].dtype == BF16 and st["exp_avg_sq"].dtype == FP32
    assert any(c.abs().sum() > 0 for c in opt.updater.compensation.values())


@pytest.mark.parametrize("opt_fn", [sgd, adamw], ids=["sgd", "adamw"])
def test_the_default_is_explicit_kahan_bit_for_bit(opt_fn):
    model, opt = build(opt_fn)
    ref, ref_opt = build(opt_fn, update="kahan")
    train(model, opt, 5)
    train(ref, ref_opt, 5)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_bitwise(a.detach(), b.detach())
        assert_bitwise(opt.updater.compensation[a], ref_opt.updater.compensation[b])


@pytest.mark.parametrize("opt_fn", [sgd, adam], ids=["sgd", "adam"])
def test_explicit_update_none_is_the_optimizers_own_bf16_step(opt_fn):
    """The old O3 default, kept behind ``update=None``: the wrapped optimizer steps the bf16
    weights in bf16 arithmetic, exactly as the same torch optimizer on a bf16 copy does."""
    model, opt = build(opt_fn, update=None)
    assert opt.updater is None
    plain = [p.detach().clone().requires_grad_() for p in model.parameters()]
    plain_opt = opt_fn(plain)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, q in zip(model.parameters(), plain):
            p.grad = torch.randn(p.shape, generator=g).to(BF16)
            q.grad = p.grad.clone()
        opt.step()
        plain_opt.step()
    for p, q in zip(model.parameters(), plain):
        assert_bitwise(p.detach(), q.detach())
        for k, v in plain_opt.state[q].items():
            assert_bitwise(opt.state[p][k], v)
            if k != "step":
                assert v.dtype == BF16


def test_fp16_default_is_unchanged():
    _, opt = build(sgd, FP16)
    assert opt.updater is None  # fp16 SGD: its own fp16 step
    _, opt = build(adamw, FP16)
    assert opt.updater.update == "kahan"  # fp16 Adam: eps rounds to 0 in fp16 arithmetic
    _, opt = build(lambda ps: torch.optim.RMSprop(ps, lr=1e-3), FP16)
    assert opt.updater.update == "kahan"  # eps=1e-8 rounds to 0 in fp16


def test_sparse_gradients_keep_the_optimizers_own_step():
    """Update modes need dense gradients: SparseAdam, and any optimizer over a sparse embedding,
    keep update=None; the dense head's optimizer still gets the default."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(20, 8, sparse=True), nn.Linear(8, 1)
    model = nn.Sequential(emb, head)
    opts = [torch.optim.SparseAdam(list(emb.parameters()), lr=0.05), adam(head.parameters())]
    model, opts = initialize(model, opts, "O3", BF16)
    assert opts[0].updater is None and opts[1].updater.update == "kahan"
    emb2 = nn.Embedding(20, 8, sparse=True)
    _, o = initialize(emb2, torch.optim.SGD(emb2.parameters(), lr=0.1), "O3", BF16)
    assert o.updater is None
    ids, y = torch.randint(0, 20, (8, 3)), torch.randn(8, 3, 1)
    losses = []
    for _ in range(20):
        loss = (model(ids).float() - y).pow(2).mean()
        with mixprec.scale_loss(loss, opts) as scaled:
            scaled.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_states_and_seed_apply_to_the_default_update():
    _, opt = build(adamw, optimizer_states=BF16, update_seed=3)
    assert (
        opt.updater.update == "kahan"
        and opt.updater.plan.optimizer_states == BF16
        and opt.updater.seed == 3
    )
    with pytest.raises(ValueError, match=r"Recipe\(optimizer_states=.*\): applies to an update"):
        build(adamw, update=None, optimizer_states=BF16)  # explicitly no update mode
    with pytest.raises(ValueError, match=r"apply to an update mode"):
        build(sgd, FP16, optimizer_states=FP16)  # fp16 SGD's default is None
    with pytest.raises(ValueError, match=r"Recipe\(update_seed=1\): applies to an update mode"):
        mixprec.Recipe("O2", BF16, update_seed=1)  # masters


def test_compensation_starts_from_the_fp32_values_the_model_held():
    """Load fp32 weights, then initialize (Apex's order): ``w + c`` keeps them to about 16
    bits, as a load after initialize does; plain bf16 keeps 8."""
    fp32 = make_model(4)
    want = {k: v.clone() for k, v in fp32.state_dict().items()}
    model, opt = build(adamw, seed=4)
    got = mixprec.fp32_state_dict(model, opt)
    later, later_opt = build(adamw, seed=9)
    later.load_state_dict(want)
    loaded = mixprec.fp32_state_dict(later, later_opt)
    assert (want["0.weight"] - want["0.weight"].to(BF16).float()).abs().max() > 0
    for k, v in want.items():  # (the LayerNorm's ones and zeros round exactly)
        rounding = (v - v.to(BF16).float()).abs().max()
        assert (got[k] - v).abs().max() <= rounding / 64, k
        assert_bitwise(got[k], loaded[k])  # either order: the same compensation


# ------------------------------------------------- checkpoints across the change


def test_update_none_checkpoint_resumes_under_the_default(tmp_path):
    """A checkpoint of the old default (no "lean" entry, bf16 m and v) loads under the new one:
    compensation zero (the weights are exact bf16 values), and the next step is the fp32 Adam
    step on the widened state, rounded to bf16."""
    old, old_opt = build(adam, update=None)
    train(old, old_opt, 3)
    torch.save({"model": old.state_dict(), "opt": old_opt.state_dict()}, tmp_path / "c.pt")
    ckpt = torch.load(tmp_path / "c.pt", weights_only=True)
    assert "lean" not in ckpt["opt"]["param_groups"][0]["mixprec"]

    model, opt = build(adam, seed=7)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.updater.update == "kahan"
    assert all(torch.equal(c, torch.zeros_like(c)) for c in opt.updater.compensation.values())
    params = list(model.parameters())
    for p, q in zip(params, old.parameters()):
        assert_bitwise(p.detach(), q.detach())
        # stored as a step of the new default stores it: fp32 (the saved bf16 values widened)
        assert opt.state[p]["exp_avg_sq"].dtype == FP32
        assert_bitwise(opt.state[p]["exp_avg_sq"], old_opt.state[q]["exp_avg_sq"].float())

    x, y = batch(2)
    opt.backward(mse(model, x, y))
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = adam(ref)
    for r, p in zip(ref, params):
        r.grad = p.grad.float()
        ref_opt.state[r] = {
            k: v.clone() if k == "step" else v.float().clone() for k, v in opt.state[p].items()
        }
    ref_opt.step()
    opt.step()
    for p, r in zip(params, ref):
        # weight + compensation hold the fp32 step: within the compensation's own rounding
        # (2**-9 of a residual under half a bf16 ulp) and the 1 fp32 ulp noted below
        held = p.detach().float() + opt.updater.compensation[p].float()
        torch.testing.assert_close(held, r.detach(), rtol=2.0**-17, atol=0)
        assert opt.state[p]["exp_avg_sq"].dtype == FP32
        # the one-pass update rounds each fp32 operation on its own; torch's for-loop, built with
        # contraction, may fuse v * beta2 + (1 - beta2) * g * g into one rounding: 1 ulp apart
        torch.testing.assert_close(
            opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], rtol=2.0**-23, atol=0
        )


def test_a_kahan_checkpoint_under_update_none_folds_its_compensation():
    """update=None keeps no compensation: each weight becomes weight + compensation, rounded
    to nearest (mixprec._core.recipe_change), and the change is reported."""
    model, opt = build(adam)
    train(model, opt, 2)
    sd = opt.state_dict()
    want = [(p.detach().float() + opt.updater.compensation[p].float()).to(p.dtype)
            for p in model.parameters()]  # fmt: skip
    plain_model, plain = build(adam, update=None)
    plain_model.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="'kahan' -> None"):
        plain.load_state_dict(sd)
    for p, w in zip(plain_model.parameters(), want):
        assert torch.equal(p.detach(), w)
    assert plain.state  # the moments came with it


# ------------------------------------------------- small updates: the old default stalls


def _least_squares(level=None, **kw):
    """Final MSE of SGD on a 64 x 16 least-squares problem from a bf16 ``Linear(16, 1)``; the
    updates fall below half a bf16 ulp of the weights long before the fit is done."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x @ (2 * torch.randn(16, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Linear(16, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=2e-2)
    if level is not None:
        model, opt = initialize(model, opt, mixprec.Recipe(level, BF16, **kw))
    for _ in range(150):
        loss = (model(x).float() - y).pow(2).mean()
        opt.backward(loss) if level is not None else loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float((x @ model.weight.float().t() - y).pow(2).mean())


def test_small_updates_the_default_tracks_fp32_and_update_none_stalls():
    fp32 = _least_squares()
    default = _least_squares(level="O3")
    old = _least_squares(level="O3", update=None)
    assert 0 < fp32 < 0.05
    assert default <= 1.25 * fp32, (default, fp32)
    assert old >= 5 * fp32, (old, fp32)  # the same bound fails for the old default


# ------------------------------------------------- the benchmark script


def test_bench_o3_accuracy_smoke(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import bench_o3_accuracy
    finally:
        sys.path.pop(0)
    out = tmp_path / "o3.json"
    bench_o3_accuracy.main(
        ["--steps", "3", "--seeds", "0", "--eval-every", "3", "--quick", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert "| O3 bf16 default | kahan |" in text and "| O3 bf16 update=None | None |" in text
    doc = json.loads(out.read_text())
    res = doc["results"]["0"]
    assert res["O3 bf16 default"]["update"] == "kahan"
    assert res["O3 bf16 update=None"]["update"] is None
    assert res["O3 bf16 default"]["bytes_per_param"]["compensation"] == 2.0
    assert all(0 <= r["test_accuracy"] <= 1 and r["time_vs_fp32"] > 0 for r in res.values())
    assert doc["machine"]["torch"] == torch.__version__
    bench_o3_accuracy.main(["--render", str(out)])  # the saved run's table, ratios of medians
    rendered = capsys.readouterr().out
    assert doc["table"] in rendered
    fp32_ms = 1e3 * res["fp32"]["median_step_s"]
    row = next(r for r in doc["table"].splitlines() if r.startswith("| O3 bf16 default |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ms, ratio = float(cells[-6]), float(cells[-5].rstrip("x"))  # before the 4 B/param cells
    # the step times print 3 significant digits each, the ratio 2 decimals
    expected = ms / float(f"{fp32_ms:.3g}")
    assert abs(ratio - expected) <= 0.005 + 0.011 * expected, (ratio, expected)
