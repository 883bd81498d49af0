"""Pure 16-bit training with compensated / stochastically rounded updates.

Covers: the 1.0 + 1e-3 x 10,000 experiment per update mode, unbiasedness of stochastic rounding
(a z-test with a power check against truncation), reproducibility, equality of the fp32 math with
the wrapped optimizer's own, state dtypes, skipped steps leaving everything bitwise untouched,
bit-exact resume through state_dict, other optimizers, chunking, and input validation.
"""

from __future__ import annotations

import copy
import math
import types
import warnings

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise, batch, make_model, mse, poisoned, train

import mixprec
from mixprec import initialize
from mixprec._core.update import spec, state_codes
from mixprec._core.update.choice import UpdatePlan
from mixprec.numerics import stochastic_round

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MODES = ("nearest", "kahan", "stochastic")


def build(update, opt_fn, dtype=BF16, seed=0, **kw):
    model = make_model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe = mixprec.Recipe("O3", dtype, update=update, **kw)
        return initialize(model, opt_fn(model.parameters()), recipe)


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)


def sgd(params, **kw):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw)


def widened(opt, p):
    """The fp32 value the update starts from: ``w + c`` (Kahan; ``c`` starts as the residual of
    rounding the fp32 initialisation), else ``w``."""
    comp = opt.updater.compensation.get(p)
    return p.detach().float() + (0 if comp is None else comp.float())


# ------------------------------------------------- (a) 1.0 + 1e-3, ten thousand times


def _accumulate(update, chains=256, steps=10_000, delta=1e-3):
    """``chains`` bf16 weights at 1.0, each given ``steps`` SGD updates of +``delta``."""
    model = nn.Linear(1, chains, bias=False)
    nn.init.ones_(model.weight)
    model, opt = initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=delta),
        mixprec.Recipe("O3", BF16, update=update),
    )
    w = model.weight
    grad = torch.full_like(w, -1.0)  # SGD adds lr * 1.0 each step
    for _ in range(steps):
        w.grad = grad.clone()
        opt.step()
    return w.detach().float().view(-1)


def _sr_sigma(start=1.0, steps=10_000, delta=1e-3):
    """Std of the SR result: the rounding errors are martingale increments with variance
    gap * delta' * (1 - delta'/gap) at weight w_t ~ start + t*delta (gap = ulp_bf16(w_t),
    delta' = delta modulo the gap); summed along the mean path."""
    var, w = 0.0, start
    for _ in range(steps):
        gap = 2.0 ** (math.floor(math.log2(w)) - 7)
        frac = (delta % gap) / gap
        var += gap * gap * frac * (1 - frac)
        w += delta
    return math.sqrt(var)


def test_ten_thousand_small_updates_nearest_stalls_kahan_and_stochastic_do_not():
    fp32 = 1.0 + 10_000 * 1e-3
    # the old O3 step (bf16 arithmetic) and fp32 math rounded to nearest both stall at 1.0
    assert torch.equal(_accumulate("nearest", chains=4), torch.ones(4))
    assert torch.equal(_accumulate(None, chains=4, steps=100), torch.ones(4))  # every step lost
    kahan = _accumulate("kahan", chains=4)
    assert torch.all((kahan - fp32).abs() <= 0.01 * fp32), kahan
    # stochastic: 256 independent seeded chains; unbiased with the std derived in _sr_sigma
    # (~0.59). Band: each chain within 5 sigma (p < 6e-7 per chain), the mean of the 256 within
    # 4 sigma / 16 of 11.0 (p < 7e-5); a biased rounding would miss the mean band by far.
    sr = _accumulate("stochastic")
    sigma = _sr_sigma()
    assert 0.4 < sigma < 0.8
    assert torch.all((sr - fp32).abs() <= 5 * sigma)
    assert abs(sr.mean().item() - fp32) <= 4 * sigma / math.sqrt(sr.numel())
    assert 0.5 * sigma < sr.std().item() < 1.5 * sigma  # the noise is the predicted size


# ------------------------------------------------- (b) stochastic rounding is unbiased


def _neighbours(x, dtype):
    near = x.to(dtype)
    other = torch.nextafter(near, torch.where(x > near.float(), torch.inf, -torch.inf).to(dtype))
    lo = torch.minimum(near.float(), other.float())
    hi = torch.maximum(near.float(), other.float())
    return lo, hi


def _z_scores(x, rounded, dtype):
    lo, hi = _neighbours(x, dtype)
    p = ((x - lo) / (hi - lo)).double()
    mean = rounded.double().mean(0)
    n = rounded.shape[0]
    sd = (hi - lo).double() * torch.sqrt(p * (1 - p) / n)
    return (mean - x.double()) / sd, lo, hi


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_rounding_is_unbiased(dtype):
    g = torch.Generator().manual_seed(0)
    k, n = 400, 2000
    mags = torch.exp(torch.empty(k).uniform_(-12, 6, generator=g))  # fp16: subnormals too
    x = mags * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    lo, hi = _neighbours(x, dtype)
    keep = (x != lo) & (x != hi)  # exactly representable values have nothing to round
    x = x[keep]
    gen = torch.Generator().manual_seed(1)
    samples = torch.stack([stochastic_round(x, dtype, gen) for _ in range(n)]).float()
    z, lo, hi = _z_scores(x, samples, dtype)
    # every sample is one of the two neighbours
    assert torch.all((samples == lo) | (samples == hi))
    # per value z ~ N(0, 1) by the CLT (n p (1-p) is large for these draws): the mean of k
    # independent z-scores has sd 1/sqrt(k) and their mean square is ~1 (chi^2_k / k).
    assert abs(z.mean().item()) < 4 / math.sqrt(len(z))
    assert 0.8 < z.pow(2).mean().item() < 1.2
    # power: truncation toward zero, which is biased, fails the same statistic by far
    trunc = torch.where(x > 0, lo, hi).expand(n, -1)
    z_trunc, _, _ = _z_scores(x, trunc, dtype)
    assert z_trunc.pow(2).mean().item() > 100


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_the_update_rounds_without_bias(dtype):
    """The keyed rounding of the update itself (not the public stochastic_round): one SGD step
    moves 2**17 weights in [1, 2) by a known fraction (0, 0.5) of their ulp, exact in fp32; the
    mean rounding error is 0 ulp within 7 standard deviations (0.5 / sqrt(2**17) ulp each). An
    fp16 rounding whose uniforms cover half of [0, 1) (23 random bits read as 24) was +0.25."""
    ulp = 2.0**-7 if dtype == BF16 else 2.0**-10
    g = torch.Generator().manual_seed(0)
    start = 1 + torch.randint(0, int(1 / ulp), (256, 512), generator=g) * ulp  # exact in dtype
    frac = torch.randint(1, 128, (256, 512), generator=g) / 256  # in (0, 0.5): nearest is down
    model = nn.Linear(512, 256, bias=False)
    with torch.no_grad():
        model.weight.copy_(start)
    recipe = mixprec.Recipe("O3", dtype, update="stochastic", loss_scale=None)
    model, opt = initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), recipe)
    w = model.weight
    assert torch.equal(w.float(), start)
    w.grad = (-frac * ulp).to(dtype)  # exact: 7 significant bits
    opt.step()
    err = (w.detach().double() - (start + frac * ulp).double()) / ulp
    up = w.detach().float() > start
    assert bool(((err - (1 - frac)).abs() < 1e-9)[up].all())  # one of the two neighbours
    assert bool(((err + frac).abs() < 1e-9)[~up].all())
    assert abs(err.mean().item()) < 7 * 0.5 / math.sqrt(err.numel()), err.mean().item()
    # and each weight rounds up with probability frac (that rounding: twice as often)
    assert abs(up.double().mean().item() - frac.double().mean().item()) < 0.01


def test_stochastic_rounding_is_seeded_and_validated():
    x = torch.randn(10_000)
    a = stochastic_round(x, BF16, torch.Generator().manual_seed(5))
    b = stochastic_round(x, BF16, torch.Generator().manual_seed(5))
    c = stochastic_round(x, BF16, torch.Generator().manual_seed(6))
    assert a.dtype == BF16 and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(
        stochastic_round(torch.tensor([1.0, -2.5, 0.0]), BF16),
        torch.tensor([1.0, -2.5, 0.0], dtype=BF16),
    )  # exact values stay
    assert torch.isinf(stochastic_round(torch.tensor([math.inf]), BF16)).all()
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(x.double())
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        stochastic_round(x, torch.float32)


# ------------------------------------------------- the fp32 math is the optimizer's own


@pytest.mark.parametrize("kernel", ["default", "loop"])
@pytest.mark.parametrize("opt_fn", [adamw, sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("update", ["nearest", "kahan"])
def test_one_step_equals_the_fp32_step_rounded(update, opt_fn, kernel, monkeypatch):
    """The reference (the chunk path) steps the temporaries with torch's fused kernel under
    the optimizer's defaults (the fp32 fused step); an explicit foreach=False keeps torch's
    loop, bit for bit. The one-pass backends are checked against it in test_update_backends."""
    monkeypatch.setattr(spec, "CPU_BACKEND", "chunk")
    chosen = {} if kernel == "default" else {"foreach": False}
    model, opt = build(update, lambda ps: opt_fn(ps, **chosen), optimizer_states=FP32)
    x, y = batch()
    opt.backward(mse(model, x, y))
    params = list(model.parameters())
    ref = [widened(opt, p).requires_grad_() for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.float()
    ref_opt = opt_fn(ref, **({"fused": True} if kernel == "default" else chosen))
    ref_opt.step()
    opt.step()
    for p, r in zip(params, ref):
        assert p.dtype == BF16
        assert_bitwise(p.detach(), r.detach().to(BF16))  # round to nearest of the fp32 step
        if update == "kahan":
            c = opt.updater.compensation[p]
            assert c.dtype == BF16
            assert_bitwise(c, (r.detach() - p.detach().float()).to(BF16))
    # the state is the fp32 optimizer's, bitwise (optimizer_states=fp32)
    for p, r in zip(params, ref):
        for k, v in ref_opt.state[r].items():
            assert_bitwise(opt.state[p][k], v)


@pytest.mark.parametrize("update", MODES)
@pytest.mark.parametrize("opt_fn", [adamw, sgd], ids=["adamw", "sgd"])
def test_every_mode_trains_with_sgd_and_adamw(update, opt_fn):
    model, opt = build(update, opt_fn)
    losses = train(model, opt, 30)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    for p in model.parameters():
        assert p.dtype == BF16
        st = opt.state[p]
        if "exp_avg" in st:  # optimizer_states="auto": first moment bf16, second fp32
            assert st["exp_avg"].dtype == BF16 and st["exp_avg_sq"].dtype == FP32
        else:
            assert st["momentum_buffer"].dtype == BF16
    comps = opt.updater.compensation
    assert (len(comps) == len(list(model.parameters()))) == (update == "kahan")
    assert all(c.dtype == BF16 for c in comps.values())


@pytest.mark.parametrize(
    ("states", "expect"),
    [
        (BF16, (BF16, BF16)),
        (FP32, (FP32, FP32)),
        ({"exp_avg": BF16, "exp_avg_sq": BF16}, (BF16, BF16)),
        ({"exp_avg_sq": BF16}, (FP32, BF16)),
    ],
)
def test_optimizer_states(states, expect):
    model, opt = build("kahan", adamw, optimizer_states=states)
    train(model, opt, 2)
    for p in model.parameters():
        assert (opt.state[p]["exp_avg"].dtype, opt.state[p]["exp_avg_sq"].dtype) == expect


def test_bf16_second_moment_stops_decaying_which_is_why_auto_keeps_it_fp32():
    """With beta2 = 0.999, v <- 0.999 v moves v by 2**-10 of itself: under half a bf16 ulp
    (2**-8 relative), so a bf16 exp_avg_sq never decays; fp32 decays as 0.999**t."""
    out = {}
    for state_dtype in ("auto", BF16):
        p = nn.Parameter(torch.ones(4, dtype=BF16))
        opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.999))
        plan = UpdatePlan(masters=False, update="kahan", optimizer_states=state_dtype)
        updater = mixprec._core.update.modes.ModeUpdater(opt, plan)
        p.grad = torch.ones_like(p)
        updater.step()
        for _ in range(200):
            p.grad = torch.zeros_like(p)
            updater.step()
        out[state_dtype] = opt.state[p]["exp_avg_sq"].float()
    expect = (1 - 0.999) * 0.999**200
    torch.testing.assert_close(out["auto"], torch.full((4,), expect), rtol=1e-5, atol=0)
    assert torch.all(out[BF16] > 1.15 * expect)  # stuck near its first value 1e-3


# ------------------------------------------------- skipped steps, checkpoints


@pytest.mark.parametrize("update", MODES)
def test_skipped_step_leaves_weights_compensation_state_and_rng_untouched(update):
    model, opt = build(update, adamw, loss_scale="dynamic")
    train(model, opt, 3)
    before = (copy.deepcopy(list(model.state_dict().values())), copy.deepcopy(opt.state_dict()))
    x, y = batch(9)
    with poisoned(next(model.parameters())):
        opt.backward(mse(model, x, y))
    opt.step()
    assert opt.step_skipped
    after = (list(model.state_dict().values()), opt.state_dict())
    for a, b in zip(before[0], after[0]):
        assert_bitwise(a, b)
    sb, sa = before[1], after[1]
    lb, la = sb["param_groups"][0]["mixprec"]["lean"], sa["param_groups"][0]["mixprec"]["lean"]
    for a, b in zip(lb["compensation"], la["compensation"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert lb["steps"] == la["steps"] > 0  # a skipped step does not count: same rounding keys
    for i, st in sb["state"].items():
        for k, v in st.items():
            assert_bitwise(v, sa["state"][i][k])
    # and the next clean step proceeds
    opt.zero_grad()
    train(model, opt, 1)
    assert not opt.step_skipped


@pytest.mark.parametrize("update", MODES)
def test_resume_from_state_dict_is_bit_exact(update, tmp_path):
    """The resumed optimizer is built with another init and another rounding seed: the
    checkpoint's seed is the one that continues the run (a seed not restored passed while
    both sides used the same one)."""
    model, opt = build(update, adamw, update_seed=5)
    train(model, opt, 3)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    train(model, opt, 4, seed=10)

    # different init and rounding seed: everything must come back
    resumed, ropt = build(update, adamw, seed=7, update_seed=6)
    ckpt = torch.load(path, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    for p in resumed.parameters():  # the fp32 second moment is not cast to bf16 on load
        assert ropt.state[p]["exp_avg_sq"].dtype == FP32
    train(resumed, ropt, 4, seed=10)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert_bitwise(a.detach(), b.detach())
    for a, b in zip(opt.updater.compensation.values(), ropt.updater.compensation.values()):
        assert_bitwise(a, b)
    for a, b in zip(model.parameters(), resumed.parameters()):
        for k in opt.state[a]:
            assert_bitwise(opt.state[a][k], ropt.state[b][k])


def test_checkpoint_of_another_update_mode_folds_its_compensation():
    """A Kahan checkpoint under stochastic rounding: each weight becomes weight + compensation
    rounded to nearest (mixprec._core.recipe_change), and the change is reported."""
    model, opt = build("kahan", adamw)
    train(model, opt, 3)
    want = [(p.detach().float() + opt.updater.compensation[p].float()).to(p.dtype)
            for p in model.parameters()]  # fmt: skip
    other_model, other = build("stochastic", adamw)
    other_model.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="'kahan' -> 'stochastic'"):
        other.load_state_dict(opt.state_dict())
    for p, w in zip(other_model.parameters(), want):
        assert_bitwise(p.detach(), w)
    assert other.last_load_report[0] == "update: 'kahan' -> 'stochastic'"


# ------------------------------------------------- other optimizers, chunks, fp16, errors


@pytest.mark.parametrize("opt_cls", [torch.optim.RMSprop, torch.optim.Adamax, torch.optim.Adam])
def test_wraps_other_per_parameter_optimizers(opt_cls):
    model, opt = build("kahan", lambda ps: opt_cls(ps, lr=1e-2), optimizer_states=FP32)
    x, y = batch()
    opt.backward(mse(model, x, y))
    params = list(model.parameters())
    ref = [widened(opt, p).requires_grad_() for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.float()
    opt_cls(ref, lr=1e-2).step()
    opt.step()
    for p, r in zip(params, ref):
        assert_bitwise(p.detach(), r.detach().to(BF16))
    losses = train(model, opt, 20)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("update", "dtype"), [(u, BF16) for u in MODES] + [("stochastic", FP16)])
def test_chunking_does_not_change_the_result(update, dtype, monkeypatch):
    """The reference's chunks of fp32 temporaries round every parameter alike, whatever size."""
    monkeypatch.setattr(spec, "CPU_BACKEND", "chunk")
    runs = []
    for chunk in (2**20, 20):  # one chunk vs a chunk per parameter or two
        model, opt = build(update, adamw, dtype)
        opt.updater._chunk_size = lambda device, chunk=chunk: chunk
        train(model, opt, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_keyed_rounding_of_a_shard_equals_that_part_of_the_whole(dtype):
    """The bits of an element depend on its index in the whole parameter: rounding dim-0 shards
    (FSDP2) at their offsets, in any order, equals rounding the whole tensor."""
    from mixprec._core.update.rounding import keyed_round_, round_keys

    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(3)).reshape(-1)
    key, mix = round_keys(5, 11, 2)
    scratch = (torch.empty(x.numel()), torch.empty(x.numel()))
    whole = keyed_round_(x.clone(), dtype, [(x.numel(), 0, key)], mix, scratch).to(dtype)
    rows = [(0, 4), (4, 7)]  # uneven, as torch.chunk shards 7 rows over 2 ranks
    parts = {}
    for a, b in reversed(rows):
        part = x[a * 300 : b * 300].clone()
        parts[a] = keyed_round_(part, dtype, [(part.numel(), a * 300, key)], mix, scratch)
    assert_bitwise(whole, torch.cat([parts[a].to(dtype) for a, _ in rows]))
    other = keyed_round_(x.clone(), dtype, [(x.numel(), 0, round_keys(5, 12, 2)[0])], mix, scratch)
    assert not torch.equal(whole, other.to(dtype))  # another step's key: other bits


def test_released_and_held_gradients_round_alike():
    """Released gradients step one parameter at a time inside backward, in reverse order; with
    keyed rounding the weights are bit-identical to holding the gradients."""
    runs = []
    for gradients in ("held", "released"):
        model = make_model(0)
        recipe = mixprec.Recipe("lean", BF16, gradients=gradients)
        model, opt = initialize(model, adamw(model.parameters()), recipe)
        assert (opt.updater.gradients == "released") == (gradients == "released")
        train(model, opt, 4)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise(a, b)


def _retained_bytes(opt, model) -> int:
    """Bytes of the tensors reachable from ``opt`` (through containers and object attributes)
    that are none of what a training state keeps: weights, optimizer state, compensation."""
    kept = {t.untyped_storage().data_ptr() for t in model.parameters()}
    kept |= {c.untyped_storage().data_ptr() for c in opt.updater.compensation.values()}
    for c in opt.updater._codes.values():  # this step's gradients, coded ("auto"'s first step)
        kept |= {t.untyped_storage().data_ptr() for t in (c.codes, c.scales, c.norm)}
    for st in opt.state.values():
        for v in st.values():
            parts = (v.codes, v.scale) if hasattr(v, "codes") else (v,)
            kept |= {t.untyped_storage().data_ptr() for t in parts if isinstance(t, torch.Tensor)}
    found: dict[int, int] = {}
    seen, todo = set(), [opt]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif hasattr(obj, "__dict__"):
            todo.append(vars(obj))
    return sum(n for ptr, n in found.items() if ptr not in kept)


@pytest.mark.parametrize(
    "recipe",
    [
        mixprec.Recipe("lean", BF16),  # released gradients: scratch of the backward's steps
        mixprec.Recipe("lean", BF16, gradients="held"),
        mixprec.Recipe("O3", FP16, update="kahan", loss_scale=None),
    ],
    ids=["lean-released", "lean-held", "kahan-fp16"],
)
def test_no_fp32_scratch_outlives_a_step(recipe):
    """The fp32 temporaries of the update (several MB: a chunk is 2**20 elements on a CPU) exist
    during a step only: between steps the optimizer holds nothing beyond the training state
    (a few scalars: loss-scale flags and counters)."""
    model = make_model(0)
    model, opt = initialize(model, adamw(model.parameters()), recipe)
    assert _retained_bytes(opt, model) < 4096
    x, y = batch()
    for _ in range(2):
        opt.backward(mse(model, x, y))
        assert _retained_bytes(opt, model) < 4096  # released: freed at the backward's end
        opt.step()
        opt.zero_grad()
        assert _retained_bytes(opt, model) < 4096


@pytest.mark.parametrize(
    "recipe",
    [
        mixprec.Recipe("O3", BF16, update="kahan"),
        mixprec.Recipe("O3", BF16, update="stochastic", update_seed=3),
        mixprec.Recipe("lean", BF16),  # released gradients, 8-bit states
    ],
    ids=["kahan", "stochastic", "lean"],
)
def test_a_deep_copy_of_model_and_optimizer_trains_on_alike(recipe):
    """``copy.deepcopy((model, opt))`` forks a run: the copy owns its weights, states, codes
    and rounding keys, so it steps exactly as the original does, and the original's steps
    leave it as it was."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_codes, "MIN_NUMEL", 1)  # this model's weights get 8-bit codes too
        model = make_model(0)
        model, opt = initialize(model, adamw(model.parameters()), recipe)
        train(model, opt, 2)
        twin, twin_opt = copy.deepcopy((model, opt))
        at_copy = [p.detach().clone() for p in twin.parameters()]
        train(model, opt, 2, seed=4)
        for p, before in zip(twin.parameters(), at_copy):
            assert_bitwise(p.detach(), before)
        train(twin, twin_opt, 2, seed=4)
    if opt.updater.gradients == "released":  # the copy steps in backward too, and refuses clipping
        twin_opt.backward(mse(twin, *batch()))
        assert all(p.grad is None for p in twin.parameters())
        with pytest.raises(RuntimeError, match="released in backward"):
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        twin_opt.step()
        twin_opt.zero_grad()
        train(model, opt, 1)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert_bitwise(a.detach(), b.detach())


@pytest.mark.parametrize("update", MODES)
def test_fp16_parameters(update):
    model, opt = build(update, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), FP16)
    losses = train(model, opt, 20)
    assert all(p.dtype == FP16 for p in model.parameters())
    assert losses[-1] < losses[0]


def test_add_param_group_gets_compensation():
    model = make_model()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    model, opt = initialize(
        model, torch.optim.SGD(first, lr=0.1), mixprec.Recipe("O3", BF16, update="kahan")
    )
    opt.add_param_group({"params": rest})
    assert set(opt.updater.compensation) == set(model.parameters())
    train(model, opt, 2)


def test_released_steps_follow_parameters_moved_between_groups():
    """A released parameter steps with its own group's hyperparameters, found again after the
    user moves parameters between groups (here: swapped in place, the lists' lengths kept)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    (w0, b0), (w1, b1) = model[0].parameters(), model[1].parameters()
    groups = [{"params": [w0, b0], "lr": 1e-2}, {"params": [w1, b1], "lr": 0.0}]
    recipe = mixprec.Recipe("lean", BF16, gradients="released")
    model, opt = initialize(model, torch.optim.AdamW(groups), recipe)
    x, y = batch(0, 8)

    def step() -> list[torch.Tensor]:
        before = [p.detach().clone() for p in (w0, w1)]
        opt.backward(mse(model, x, y))
        opt.step()
        opt.zero_grad()
        return [not torch.equal(a, p) for a, p in zip(before, (w0, w1))]

    assert step() == [True, False]  # w0 in the lr 1e-2 group, w1 in the lr 0 group
    groups = opt.param_groups
    groups[0]["params"][0], groups[1]["params"][0] = w1, w0  # swap the weights' groups
    assert step() == [False, True]


def test_a_clip_of_an_added_groups_released_gradients_is_refused():
    """Parameters added with add_param_group under released gradients are stepped in backward
    like the first group's, so a clip of their gradients alone (gone by then) is refused, not
    a silent norm of nothing."""
    model = make_model()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    recipe = mixprec.Recipe("lean", BF16, gradients="released")
    model, opt = initialize(model, torch.optim.AdamW(first, lr=1e-2), recipe)
    opt.add_param_group({"params": rest})
    x, y = batch(0, 8)
    opt.backward(mse(model, x, y))
    assert all(p.grad is None for p in rest)  # stepped and freed in backward
    with pytest.raises(RuntimeError, match="released"):
        torch.nn.utils.clip_grad_norm_(rest, 1.0)


def test_validation_errors():
    def make():
        m = make_model()
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    R = mixprec.Recipe
    with pytest.raises(ValueError, match=r"Recipe\(update='kahan'\): .* has master weights"):
        R("O2", BF16, update="kahan")
    with pytest.raises(ValueError, match=r"Recipe\(update='kahan'\): .* has fp32 weights"):
        R("O1", BF16, update="kahan")
    with pytest.raises(ValueError, match=r"Recipe\(optimizer_states=.*applies to an update mode"):
        R("O3", BF16, update=None, optimizer_states=BF16)
    with pytest.raises(ValueError, match="apply to an update mode"):  # fp16 SGD: no update mode
        initialize(*make(), R("O3", FP16, optimizer_states=BF16))
    with pytest.raises(ValueError, match=r"Recipe\(update='round'\): expected one of"):
        R("O3", BF16, update="round")
    with pytest.raises(ValueError, match=r"Recipe\(optimizer_states=torch.int8\)"):
        R("O3", BF16, update="kahan", optimizer_states=torch.int8)
    with pytest.raises(ValueError, match=r"Recipe\(update_seed='7'\): expected an int"):
        R("O3", BF16, update="stochastic", update_seed="7")
    _m, o = initialize(*make(), R("O2", BF16, masters=False, update="kahan"))  # allowed
    assert o.updater is not None and o.master_params()[0].dtype in (BF16, FP32)


def test_fp32_state_dict_adds_the_compensation():
    model, opt = build("kahan", sgd)
    train(model, opt, 3)
    sd = mixprec.fp32_state_dict(model, opt)
    for name, p in model.named_parameters():
        c = opt.updater.compensation[p]
        assert sd[name].dtype == FP32
        total = p.detach().float() + c.float()
        plain = total.to(BF16) == p.detach()  # elsewhere w + c is half-way: one ulp toward w
        assert torch.equal(sd[name][plain], total[plain])
        assert torch.equal(sd[name].to(BF16), p.detach())
    assert any(c.abs().sum() > 0 for c in opt.updater.compensation.values())
    fresh = make_model()
    fresh.load_state_dict(sd)  # loads into a plain fp32 model
