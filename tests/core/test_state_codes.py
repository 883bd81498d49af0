"""Optimizer states in 8 and 4 bits: the codes, and training with them ("lean").

The codes: relative error per format, exact zeros and block maxima, signs, blocks that never
span two rows (so dim-0 shards quantize as the whole tensor does). Training: which states are
coded, the footprint, a skipped step that leaves weights and codes bit-identical, the plain
torch export, and the recipe's text and table.
"""

from __future__ import annotations

import copy
import math
import warnings
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise, assert_tree_bitwise, poisoned

import mixprec
from mixprec._core.update.state_codes import MIN_NUMEL, QuantizedState, quantizable

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16 = torch.bfloat16, torch.float16
# (format, kind) -> (largest relative error, for elements above this fraction of the block max)
BOUNDS = {
    ("8-bit", "signed"): (2.0**-4, 2.0**-12),
    ("8-bit", "sqrt"): (2.0**-5, 2.0**-14),
    ("4-bit", "signed"): (2.0**-2, 2.0**-3),
    ("4-bit", "sqrt"): (2.0**-2, 2.0**-6),
}


def _sample(kind: str, shape=(48, 700)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * torch.logspace(-4, 0, shape[-1])
    return x * x if kind == "sqrt" else x


@pytest.mark.parametrize(("fmt", "kind"), list(BOUNDS))
def test_relative_error_is_bounded_per_format(fmt, kind):
    x = _sample(kind)
    y = QuantizedState.quantize(x.clone(), fmt, kind).dequantize()
    # the error on what Adam uses: the value (first moments) or its square root
    ref, got = (x.abs(), y.abs()) if kind == "signed" else (x.sqrt(), y.sqrt())
    bound, floor = BOUNDS[(fmt, kind)]
    blocks = torch.nn.functional.pad(ref, (0, -ref.shape[1] % 256)).view(48, -1, 256)
    block_max = blocks.amax(-1, keepdim=True).expand_as(blocks).reshape(48, -1)[:, :700]
    big = ref >= floor * block_max
    rel = ((got - ref).abs() / ref)[big]
    assert big.float().mean() > 0.3 and rel.max() <= bound * 1.0001, float(rel.max())
    if kind == "signed":
        assert torch.equal(torch.sign(y[big]), torch.sign(x[big]))
    else:  # never rounded to zero, never below zero
        assert bool((y[x > 0] > 0).all()) and bool((y >= 0).all())


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit"])
@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_zeros_and_block_maxima_are_exact(fmt, kind):
    x = _sample(kind, (8, 512))
    x[3] = 0.0  # a row of zeros: scale 0, values 0
    x[5, 100:200] = 0.0
    y = QuantizedState.quantize(x.clone(), fmt, kind).dequantize()
    assert bool((y[3] == 0).all())  # the block's scale is 0
    if kind == "signed":
        assert bool((y[5, 100:200] == 0).all())
    else:  # rounded up to the smallest code, never to 0: a square 2**-32 of the block's max
        assert bool((y[5, 100:200] <= x[5, :256].max() * 2.0**-14).all())
    bx, by = x.view(8, 2, 256).abs().amax(-1), y.view(8, 2, 256).abs().amax(-1)
    torch.testing.assert_close(by, bx, rtol=2e-7, atol=0)


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit"])
@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_vanishing_blocks_stay_finite(fmt, kind):
    """A first moment decaying without gradient reaches fp32's subnormals: its reciprocal
    scale must not overflow into inf, nor an exact zero beside it become 0 * inf = NaN (an
    element whose gradient was always 0 keeps a zero moment in a vanishing block)."""
    x = _sample(kind, (4, 256))
    x[1] *= 1e-37  # subnormal squares, tiny first moments
    x[2] = 1e-44 if kind == "sqrt" else -1e-44
    x[1, 7] = x[2, 3] = 0.0
    y = QuantizedState.quantize(x.clone(), fmt, kind).dequantize()
    assert bool(torch.isfinite(y).all())
    assert bool((y[1:3].abs() <= 2.0**-100).all())
    torch.testing.assert_close(
        y[0], QuantizedState.quantize(x[:1].clone(), fmt, kind).dequantize()[0]
    )


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit"])
def test_blocks_never_span_rows_so_shards_quantize_alike(fmt):
    """Dimension-0 halves (two ranks' FSDP2 shards) give the whole tensor's codes and scales."""
    x = _sample("signed", (6, 300))  # rows of 300: a full block and a partial one
    whole = QuantizedState.quantize(x.clone(), fmt, "signed")
    top = QuantizedState.quantize(x[:4].clone(), fmt, "signed")
    bottom = QuantizedState.quantize(x[4:].clone(), fmt, "signed")
    assert torch.equal(whole.scale, torch.cat([top.scale, bottom.scale]))
    assert torch.equal(whole.codes, torch.cat([top.codes, bottom.codes]))


def test_small_and_one_dimensional_states_are_not_coded():
    assert quantizable(torch.empty(64, 64)) and quantizable(torch.empty(8, 2, 16, 16))
    assert not quantizable(torch.empty(MIN_NUMEL * 2))  # 1-D: a bias, a norm's scale
    assert not quantizable(torch.empty(16, 16))


def test_a_checkpoint_entry_is_tensors_and_ints_and_loads_back_exactly():
    q = QuantizedState.quantize(_sample("sqrt", (4, 300)), "4-bit", "sqrt")
    d = q.to_dict()
    assert {type(v) for v in d.values()} <= {torch.Tensor, list, int}
    back = QuantizedState.from_dict(d)
    assert (back.fmt, back.kind, back.shape) == ("4-bit", "sqrt", q.shape)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert back.codes.data_ptr() != q.codes.data_ptr()  # a copy: stepping one leaves the other


@pytest.mark.parametrize("fmt", ["8-bit", "4-bit"])
def test_a_deep_copy_owns_its_codes(fmt):
    """``copy.deepcopy`` of a state (a snapshot of an optimizer's state) is independent:
    storing new values into the original leaves the copy's values as they were."""
    q = QuantizedState.quantize(_sample("signed", (4, 300)), fmt, "signed")
    snap = copy.deepcopy({"exp_avg": q})["exp_avg"]
    before = q.dequantize()
    q.store_(_sample("signed", (4, 300)).flip(1))
    assert not torch.equal(q.dequantize(), before)
    assert (snap.fmt, snap.kind, snap.shape) == (q.fmt, q.kind, q.shape)
    assert torch.equal(snap.dequantize(), before)


# -- training --------------------------------------------------------------------------------


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8))


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _step(model, opt, x, y, poison=None, bad=float("inf")):
    with poisoned(poison, bad):
        opt.backward((model(x).float() - y).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _lean(dtype=BF16, **fields):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mixprec.initialize(model, opt, mixprec.Recipe("lean", dtype, **fields))


def test_lean_codes_the_large_states_and_keeps_the_rest_fp32():
    model, opt = _lean()
    x, y = _batch()
    losses = []
    for _ in range(30):
        losses.append(float((model(x).float() - y).pow(2).mean().detach()))
        _step(model, opt, x, y)
    assert losses[-1] < 0.5 * losses[0]
    for p in model.parameters():
        assert p.dtype == BF16
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            if quantizable(p):
                assert isinstance(st[key], QuantizedState) and st[key].fmt == "8-bit"
            else:
                assert st[key].dtype == torch.float32
    assert opt.state[model[0].weight]["exp_avg_sq"].kind == "sqrt"
    fp = mixprec.numerics.footprint(model, opt)
    params = list(model.parameters())
    # a code per element and an fp32 scale per block of a row (rows of 32 here: one block each)
    coded = sum(p.numel() + 4 * p.shape[0] * -(-p[0].numel() // 256) for p in params
                if quantizable(p))  # fmt: skip
    rest = sum(p.numel() for p in params if not quantizable(p))
    assert fp.bytes["optimizer_state"] == 2 * coded + 2 * 4 * rest + 4 * len(params)


@pytest.mark.parametrize(("dtype", "gradients"), [(BF16, "held"), (FP16, "auto")])
def test_a_non_finite_gradient_leaves_weights_and_codes_bit_identical(dtype, gradients):
    """Held gradients (fp16's loss scaling holds them under "auto"): the whole step is skipped."""
    model, opt = _lean(dtype, gradients=gradients)
    assert opt.updater.gradients != "released"
    x, y = _batch()
    for _ in range(3):
        _step(model, opt, x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = opt.state[model[0].weight]["exp_avg"]
    codes, scale = q.codes.clone(), q.scale.clone()
    steps = opt.updater.steps
    _step(model, opt, x, y, poison=model[0].weight)
    assert opt.step_skipped and opt.skipped_steps == 1
    for k, v in model.state_dict().items():
        assert_bitwise(v, before[k])
    assert opt.state[model[0].weight]["exp_avg"] is q
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)
    assert opt.updater.steps == steps  # the skipped step is not counted: same rounding keys


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_released_gradients_step_in_backward_and_a_non_finite_one_leaves_its_parameter(bad):
    """Each kind of non-finite value: a check that loses a sign (max instead of max of |g|)
    lets -inf through, and the weight becomes NaN with no warning."""
    model, opt = _lean(BF16, gradients="released")
    assert opt.updater.gradients == "released"
    x, y = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    (model(x).float() - y).pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())  # stepped and freed in backward
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()
    opt.zero_grad()
    first = model[0].weight
    q = opt.state[first]["exp_avg"]
    kept, codes = first.detach().clone(), q.codes.clone()
    others = [p.detach().clone() for p in list(model.parameters())[1:]]
    with pytest.warns(UserWarning, match="1 parameter.*non-finite.*left unchanged"):
        _step(model, opt, x, y, poison=first, bad=bad)
    assert_bitwise(first.detach(), kept)
    assert torch.equal(q.codes, codes)
    assert all(not torch.equal(p, b) for p, b in zip(list(model.parameters())[1:], others))
    assert bool(torch.isfinite(first).all())


def test_released_gradients_refuse_clipping_and_accumulation():
    model, opt = _lean(BF16, gradients="released")
    x, y = _batch()
    (model(x).float() - y).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="released in backward.*gradients='held'"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="released in backward"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        (model(x).float() - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    (model(x).float() - y).pow(2).mean().backward()  # after the step: a new step
    with pytest.raises(ValueError, match="gradients.*loss-scaled step"):
        mixprec.Recipe("lean", FP16, gradients="released", loss_scale="dynamic")
    with pytest.raises(ValueError, match="update mode"):
        mixprec.Recipe("O2", gradients="released")


def test_auto_releases_after_a_first_step_without_clipping_bit_for_bit():
    """'lean' ("auto", bf16) in a loop that neither clips nor accumulates: the first step codes
    the gradients (the coded run's first step, bit for bit; each one's codes freed as it is
    stepped), the next ones release them in backward: the held run's steps from that state,
    bit for bit."""
    x, y = _batch()
    coded, coded_opt = _lean(gradients="coded")
    model, opt = _lean()
    assert opt.updater.asked == "auto" and opt.updater.deciding  # the first step watches
    opt.backward((model(x).float() - y).pow(2).mean())
    assert all(p.grad is None and opt.updater.has_codes(p) for p in model.parameters())
    opt.step()
    opt.zero_grad()
    _step(coded, coded_opt, x, y)
    assert opt.updater.gradients == "released"
    assert not opt.updater._code_buffers  # nothing kept for coding once released
    for p, q in zip(model.parameters(), coded.parameters()):
        assert_bitwise(p.detach(), q.detach())
    held, held_opt = _lean(gradients="held")
    held.load_state_dict(copy.deepcopy(model.state_dict()))
    held_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load aliases tensors
    for _ in range(3):
        _step(held, held_opt, x, y)
        opt.backward((model(x).float() - y).pow(2).mean())
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        for p, q in zip(model.parameters(), held.parameters()):
            assert_bitwise(p.detach(), q.detach())
    assert_tree_bitwise(opt.fp32_state_dict(), held_opt.fp32_state_dict())
    with pytest.raises(RuntimeError, match="'auto' released them after a first step.*held"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a clip that starts later


def _loop_step(model, opt, x, y, how):
    for _ in range(2 if how == "accumulate" else 1):
        opt.backward((model(x).float() - y).pow(2).mean())
    if how == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    elif how == "opt.clip":
        opt.clip_grad_norm_(0.1)
    assert all(p.grad is None and opt.updater.has_codes(p) for p in model.parameters())
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("how", ["clip", "opt.clip", "accumulate"])
def test_auto_codes_once_the_first_step_clips_or_accumulates_and_says_so(how):
    """The loop's first step clips or accumulates: the gradients stay coded, bit for bit the
    explicitly coded run, and the warning says so once."""
    model, opt = _lean()
    coded, coded_opt = _lean(gradients="coded")
    x, y = _batch()
    with pytest.warns(UserWarning, match="gradients='auto' codes the gradients"):
        _loop_step(model, opt, x, y, how)
    for _ in range(2):
        _loop_step(model, opt, x, y, how)  # coded for good
    for _ in range(3):
        _loop_step(coded, coded_opt, x, y, how)
    assert opt.updater.gradients == "coded"
    assert opt.updater.held_for == ("accumulation" if how == "accumulate" else "clipping")
    assert str(opt.recipe) == str(coded_opt.recipe)
    for p, q in zip(model.parameters(), coded.parameters()):
        assert_bitwise(p.detach(), q.detach())
    with pytest.raises(ValueError, match="gradients='sometimes'.*expected one of"):
        mixprec.Recipe("lean", gradients="sometimes")  # the recipe checks what the updater reads


@pytest.mark.parametrize("how", ["clip", "accumulate", "plain"])
def test_a_resumed_auto_run_goes_on_as_decided(how):
    """The first step's decision (coded, released) is saved with the optimizer: the resumed
    run goes on as the saved one, bit for bit, rather than deciding again with a coded step."""
    x, y = _batch()
    model, opt = _lean()

    def step(m, o):
        if how == "plain":
            _step(m, o, x, y)
        else:
            _loop_step(m, o, x, y, how)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" says what it chose
        for _ in range(2):
            step(model, opt)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    fresh, fresh_opt = _lean()
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    assert not fresh_opt.updater.deciding and str(fresh_opt.recipe) == str(opt.recipe)
    for _ in range(2):
        step(model, opt)
        step(fresh, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert_bitwise(p.detach(), q.detach())


@pytest.mark.parametrize("how", ["value", "inf-norm"])
def test_auto_holds_where_the_first_step_clips_what_codes_cannot_give(how):
    """A clip by value, or by a norm other than 2, needs the gradients themselves: "auto"'s
    first step decodes its codes into held gradients (said), and holds them from then on;
    an explicit gradients='coded' refuses such a clip with the fix."""
    model, opt = _lean()
    x, y = _batch()

    def clip(m):
        if how == "value":
            torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3, norm_type=math.inf)

    for step in range(3):
        opt.backward((model(x).float() - y).pow(2).mean())
        with pytest.warns(UserWarning, match="decoded into held") if step == 0 else nullcontext():
            clip(model)
        assert all(p.grad is not None for p in model.parameters())
        if how == "value":
            assert all(p.grad.abs().max() <= 1e-3 for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert opt.updater.gradients == "held"
    assert "gradients=held" in str(opt.recipe)
    coded, coded_opt = _lean(gradients="coded")
    coded_opt.backward((coded(x).float() - y).pow(2).mean())
    with pytest.raises(RuntimeError, match="gradients='coded'.*gradients='held'"):
        clip(coded)


def test_a_plain_torch_optimizer_loads_the_dequantized_states():
    model, opt = _lean()
    x, y = _batch()
    for _ in range(3):
        _step(model, opt, x, y)
    sd = opt.state_dict()
    plain_state = opt.fp32_state_dict(sd)
    assert_tree_bitwise(plain_state, opt.fp32_state_dict())
    assert "mixprec" not in plain_state["param_groups"][0]
    assert isinstance(sd["state"][0]["exp_avg"], dict)  # the input is left as it was
    plain = _model(seed=5)
    plain.load_state_dict(mixprec.fp32_state_dict(model, opt))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(plain_state)
    for p, q in zip(model.parameters(), plain.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            mine = opt.state[p][key]
            want = mine.dequantize() if isinstance(mine, QuantizedState) else mine
            assert plain_opt.state[q][key].dtype == torch.float32
            assert torch.equal(plain_opt.state[q][key], want)
    before = plain[0].weight.detach().clone()
    (plain(x) - y).pow(2).mean().backward()
    plain_opt.step()
    assert not torch.equal(plain[0].weight, before)


def test_lean_recipe_text_table_and_rules():
    r = mixprec.Recipe("lean", BF16)
    assert (r.update, r.optimizer_states, r.masters, r.weights) == (
        "stochastic",
        "8-bit",
        False,
        "16-bit",
    )
    assert mixprec.Recipe(str(r)) == r
    mixed = r.replace(optimizer_states={"exp_avg": "4-bit", "exp_avg_sq": "8-bit"})
    assert mixprec.Recipe(str(mixed)) == mixed
    assert "optimizer states      2 x 8-bit   2.0 B/param" in r.table()
    assert "gradients             bf16, released in backward" in r.table()
    assert "total                             4.0 B/param" in r.table()
    assert "total                             6.0 B/param" in r.replace(gradients="held").table()
    held = mixprec.Recipe("lean", FP16).table()  # loss scaling holds the gradients
    assert "gradients             fp16        2.0 B/param" in held
    with pytest.raises(ValueError, match="optimizer_states.*'8-bit' or '4-bit'"):
        mixprec.Recipe("lean", optimizer_states="2-bit")
    with pytest.raises(ValueError, match="applies to an update mode"):
        mixprec.Recipe("O3", optimizer_states="8-bit", update=None)


@pytest.mark.parametrize("gradients", ["auto", "held"])
def test_lean_trains_a_compiled_model(gradients):
    """torch.compile of the model (aot_eager: the graph as the compiler sees it, without a C++
    toolchain): gradients still reach the release hooks (released, or coded in the first
    step), or are held for the step."""
    model, opt = _lean(gradients=gradients)
    compiled = torch.compile(model, backend="aot_eager")
    x, y = _batch()
    losses = []
    for _ in range(15):
        loss = (compiled(x).float() - y).pow(2).mean()
        opt.backward(loss)
        held = opt.updater.gradients == "held"  # else released or coded
        assert all((p.grad is None) != held for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert isinstance(opt.state[model[0].weight]["exp_avg"], QuantizedState)


def test_accumulated_gradients_are_held_and_stepped_once():
    """gradients='held': two backward passes add up, the step sees their sum once."""
    model, opt = _lean(gradients="held")
    x, y = _batch()
    for half in (slice(0, 8), slice(8, 16)):
        opt.backward((model(x[half]).float() - y[half]).pow(2).mean() / 2)
    summed = [p.grad.float() for p in model.parameters()]
    assert opt.state[model[0].weight] == {}  # nothing stepped yet
    # the same weights' gradient of the whole batch in one backward: the two halves add up to
    # it, up to bf16's rounding of each half (dropping the first half was 58% off)
    twin, twin_opt = _lean(gradients="held")
    twin_opt.backward((twin(x).float() - y).pow(2).mean())
    for got, p in zip(summed, twin.parameters(), strict=True):
        want = p.grad.float()
        assert float((got - want).norm() / want.norm()) < 0.02
    opt.step()
    assert int(opt.state[model[0].weight]["step"]) == 1


OPTIMIZERS = {
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("gradients", ["auto", "held"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lean_with_optimizers_param_groups_and_a_scheduler(name, gradients):
    model = _model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = OPTIMIZERS[name]([{"params": decay, "weight_decay": 0.1}, {"params": rest}])
    model, opt = mixprec.initialize(model, opt, mixprec.Recipe("lean", BF16, gradients=gradients))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    x, y = _batch()
    losses = []
    for _ in range(25):
        losses.append(float((model(x).float() - y).pow(2).mean().detach()))
        _step(model, opt, x, y)
        sched.step()
    assert losses[-1] < 0.6 * losses[0], losses
    assert (
        opt.param_groups[0]["lr"]
        == opt.param_groups[1]["lr"]
        < OPTIMIZERS[name]([torch.zeros(1, requires_grad=True)]).defaults["lr"]
    )
    first = "momentum_buffer" if name.startswith("sgd") else "exp_avg"
    assert isinstance(opt.state[model[0].weight][first], QuantizedState)
    assert opt.state[model[0].weight][first].kind == "signed"


SECOND_MOMENT_OPTIMIZERS = {
    "rmsprop": (lambda params: torch.optim.RMSprop(params, lr=1e-3), ("square_avg",)),
    "adagrad": (lambda params: torch.optim.Adagrad(params, lr=1e-2), ("sum",)),
    "adadelta": (lambda params: torch.optim.Adadelta(params, lr=1.0), ("square_avg", "acc_delta")),
}


@pytest.mark.parametrize("name", list(SECOND_MOMENT_OPTIMIZERS))
def test_second_moments_of_other_optimizers_keep_their_small_values(name):
    """RMSprop's, Adagrad's and Adadelta's squares span Adam's range: each decodes within the
    square-root code's error of the fp32 step's value and never to 0 where that is positive
    (coded like a signed first moment, the smallest squares of a block became 0, and
    ``g / (sqrt(0) + eps)`` a huge step)."""
    make, keys = SECOND_MOMENT_OPTIMIZERS[name]
    model = _model()
    recipe = mixprec.Recipe("lean", BF16, gradients="held")  # held: the gradient can be read
    model, opt = mixprec.initialize(model, make(model.parameters()), recipe)
    x, y = _batch()
    opt.backward((model(x).float() - y).pow(2).mean())
    w = model[0].weight
    assert quantizable(w)
    ref_w = w.detach().float().clone().requires_grad_()  # the fp32 step on the same values
    ref_w.grad = w.grad.float()
    ref = make([ref_w])
    ref.step()
    opt.step()
    for key in keys:
        want, got = ref.state[ref_w][key], opt.state[w][key]
        assert isinstance(got, QuantizedState)
        got = got.dequantize()
        positive = want > 0
        assert positive.float().mean() > 0.99
        assert bool((got[positive] > 0).all()), int((got[positive] == 0).sum())
        # the square root (what these optimizers divide by) within 8-bit's 2**-5, for the
        # elements above 2**-14 of their row's largest (rows of 32: one block each)
        root, ref_root = got.sqrt(), want.sqrt()
        big = ref_root >= 2.0**-14 * ref_root.amax(dim=1, keepdim=True)
        rel = ((root - ref_root).abs() / ref_root)[big]
        assert big.float().mean() > 0.99 and rel.max() <= 2.0**-5 * 1.0001, float(rel.max())
