"""Checkpoints resume bit for bit in every order users write them.

Orders: load the checkpoint into the plain model and optimizer, then ``initialize`` (nanoGPT's
and Apex's order); ``initialize``, then load (model first, or optimizer first). Save forms:
``mixprec.fp32_state_dict(model, opt)`` or ``model.state_dict()``, with ``opt.state_dict()``.
Every level and dtype, O3's update rules, a loss scaler mid-way through its hysteresis after
forced overflows: five more steps equal the uninterrupted run's (losses, weights, masters,
optimizer state, loss scale, skip counts). Where a resume cannot be exact, ``initialize`` says
so; those cases are tested too.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from training_helpers import (
    TinyGPT,
    assert_bitwise,
    assert_tree_bitwise,
    make_model,
    mse,
    poisoned,
)

import mixprec
from mixprec._core.resume import kahan_fp32, split_state_dict
from mixprec._core.update import state_codes

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_g = torch.Generator().manual_seed(11)
DATA = [(torch.randn(8, 8, generator=_g), torch.randn(8, 4, generator=_g)) for _ in range(11)]
POISON = {1, 2, 5, 8}  # inf gradients: two in a row back the scale off (hysteresis 2)
K, N = 6, 11  # checkpoint after K steps; the resumed run goes on to N
SCALING = mixprec.LossScaling(init_scale=16.0, growth_interval=3, hysteresis=2)


def _recipe(level, dtype, **fields) -> mixprec.Recipe:
    return mixprec.Recipe(level, dtype, loss_scale=SCALING, **fields)


CONFIGS = {
    "O0": _recipe("O0", None),
    "O1-bf16": _recipe("O1", BF16),
    "O1-fp16": _recipe("O1", FP16),
    "O2-bf16": _recipe("O2", BF16),
    "O2-fp16": _recipe("O2", FP16),
    "O3-bf16-kahan": _recipe("O3", BF16),  # the default
    "O3-bf16-stochastic": _recipe("O3", BF16, update="stochastic", update_seed=3),
    "O3-bf16-none": _recipe("O3", BF16, update=None),
    "O3-fp16-kahan": _recipe("O3", FP16),  # the default with AdamW
    "O3-fp16-stochastic": _recipe("O3", FP16, update="stochastic", update_seed=3),
    "O3-fp16-none": _recipe("O3", FP16, update=None),
    # 8-bit states (this model's weights are small: quantized by the fixture below)
    "lean-bf16": _recipe("lean", BF16, update_seed=3),
    "lean-fp16": _recipe("lean", FP16),
    "O3-bf16-4-bit": _recipe("O3", BF16, update="kahan", optimizer_states="4-bit"),
}


@pytest.fixture(scope="module", autouse=True)
def quantize_small_states():
    """Codes for every state of 2 or more dimensions: the test model's are below the size
    that is quantized by default."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_codes, "MIN_NUMEL", 1)
        yield


ORDERS = [
    "load-then-initialize",
    "initialize-then-load-model-first",
    "initialize-then-load-opt-first",
]
FORMS = ["fp32_state_dict", "model.state_dict"]


def plain(seed: int):
    model = make_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


def initialize(model, opt, config, *, resumed=False):
    recipe = CONFIGS[config]
    if resumed and recipe.update == "stochastic":  # the checkpoint's seed (3 or 0) must win
        recipe = recipe.replace(update_seed=4)
    return mixprec.initialize(model, opt, recipe)


def train(model, opt, steps) -> list[torch.Tensor]:
    losses = []
    for t in steps:
        x, y = DATA[t]
        with poisoned(model[0].weight if t in POISON else None):
            loss = mse(model, x, y)
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        assert opt.step_skipped == (t in POISON)
        losses.append(loss.detach().clone())
    return losses


def saved(obj):
    """Through torch.save / torch.load(weights_only=True), as a real checkpoint."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resume(ckpt, config: str, order: str):
    """A fresh model (another seed: nothing may come from its init) and, under stochastic
    rounding, another rounding seed (the checkpoint's must be restored), loaded in ``order``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = plain(seed=7)
        if order == "load-then-initialize":
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            model, opt = initialize(model, opt, config, resumed=True)
        else:
            model, opt = initialize(model, opt, config, resumed=True)
            if order == "initialize-then-load-opt-first":
                opt.load_state_dict(ckpt["opt"])
            model.load_state_dict(ckpt["model"])
            if order == "initialize-then-load-model-first":
                opt.load_state_dict(ckpt["opt"])
    said = [str(w.message) for w in caught if "mixprec.initialize" in str(w.message)]
    assert not said, said  # an exact resume has nothing to warn about
    return model, opt


def assert_same_run(model, opt, ref_model, ref_opt) -> None:
    assert_tree_bitwise(model.state_dict(), ref_model.state_dict())
    for (_, a), (_, b) in zip(opt._pairs, ref_opt._pairs, strict=True):
        assert_bitwise(a.detach(), b.detach())
    assert_tree_bitwise(opt.state_dict(), ref_opt.state_dict())  # masters, scalers, counters
    assert opt.slots[0].scaler.state_dict() == ref_opt.slots[0].scaler.state_dict()
    assert (opt.skipped_steps, opt.step_skipped) == (ref_opt.skipped_steps, ref_opt.step_skipped)


@pytest.fixture(scope="module")
def straight_runs():
    """The uninterrupted run of each config, and its state at the checkpoint (computed once)."""
    runs = {}

    def get(config):
        key = config
        if key not in runs:
            model, opt = initialize(*plain(seed=0), config)
            losses = train(model, opt, range(K))
            at_k = saved({"model": model.state_dict(), "opt": opt.state_dict()})
            losses += train(model, opt, range(K, N))
            runs[key] = (model, opt, losses, at_k)
        return runs[key]

    return get


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_is_bit_exact(config, order, form, straight_runs):
    _resume_is_bit_exact(config, order, form, straight_runs)


#: the update modes' configs: each resume must be checked on the one-pass update users run
FUSED = ["O3-bf16-kahan", "O3-bf16-stochastic", "O3-fp16-kahan", "lean-bf16", "O3-bf16-4-bit"]


@pytest.mark.parametrize("config", FUSED)
def test_the_update_modes_resume_through_the_one_pass_update(config, straight_runs):
    """The resumes above of the update modes ran the default one-pass update, not only the
    reference."""
    assert straight_runs(config)[1].updater.fused.fused_steps > 0


def _resume_is_bit_exact(config, order, form, straight_runs):
    ref_model, ref_opt, ref_losses, at_k = straight_runs(config)
    model, opt = initialize(*plain(seed=0), config)
    # the run to the checkpoint is the uninterrupted one's, bit for bit: what differs after
    # the resume is the resume's doing
    for a, b in zip(train(model, opt, range(K)), ref_losses[:K], strict=True):
        assert_bitwise(a, b)
    # the scaler is mid-way: backed off once (16 -> 8), one overflow into hysteresis 2 at the
    # last step, three skipped steps, the last one skipped
    scaler = opt.slots[0].scaler
    assert (scaler.scale, scaler.hysteresis_tracker, scaler.growth_tracker) == (8.0, 1, 0)
    assert (opt.skipped_steps, opt.step_skipped) == (3, True)
    if CONFIGS[config].level == "O3":
        assert (opt.updater is None) == ("none" in config)
    weights = mixprec.fp32_state_dict(model, opt) if form == "fp32_state_dict" else None
    ckpt = saved({"model": weights or model.state_dict(), "opt": opt.state_dict()})
    del model, opt

    model, opt = resume(ckpt, config, order)
    # bit for bit at the checkpoint already: weights, masters, optimizer state, scaler, counts
    assert_tree_bitwise(model.state_dict(), at_k["model"])
    assert_tree_bitwise(opt.state_dict(), at_k["opt"])
    losses = train(model, opt, range(K, N))
    for a, b in zip(losses, ref_losses[K:], strict=True):
        assert_bitwise(a, b)
    assert_same_run(model, opt, ref_model, ref_opt)


# ------------------------------------------------------------------ nanoGPT's resume, exactly


_t = torch.Generator().manual_seed(5)
TOKENS = torch.randint(0, 16, (12, 2, 2, 5), generator=_t)  # iter, micro-step, batch, block + 1


def gpt_iters(model, optimizer, iters, poison=()):
    """nanoGPT's loop, migrated: manual LR schedule, 2 micro-steps, clipping, zero_grad."""
    losses = []
    for it in iters:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (it + 1) / 12
        for micro in range(2):
            idx = TOKENS[it, micro]
            _, loss = model(idx[:, :-1], idx[:, 1:])
            with poisoned(model.fc.weight if it in poison and micro == 1 else None):
                optimizer.backward(loss / 2)
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def gpt_build(seed, level, dtype, resume_from=None):
    """nanoGPT's order: build, load the model, build the optimizer, load it, then initialize."""
    torch.manual_seed(seed)
    model = TinyGPT()
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    if resume_from is not None:
        optimizer.load_state_dict(resume_from["optimizer"])
    return mixprec.initialize(model, optimizer, level, dtype)


@pytest.mark.parametrize(("level", "dtype"), [("O2", BF16), ("O2", FP16), ("O3", BF16)])
def test_nanogpt_resume_order_is_bit_exact(level, dtype, tmp_path):
    ref_model, ref_opt = gpt_build(0, level, dtype)
    ref_losses = gpt_iters(ref_model, ref_opt, range(12), poison={2})

    model, optimizer = gpt_build(0, level, dtype)
    gpt_iters(model, optimizer, range(6), poison={2})
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.dtype == dtype
    if dtype == FP16:  # the forced overflow backed the dynamic scale off
        assert (optimizer.loss_scale, optimizer.skipped_steps) == (2.0**15, 1)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 6}
    torch.save(checkpoint, tmp_path / "ckpt.pt")

    checkpoint = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about
        model, optimizer = gpt_build(1, level, dtype, resume_from=checkpoint)
    checkpoint = None
    losses = gpt_iters(model, optimizer, range(6, 12))
    for a, b in zip(losses, ref_losses[12:], strict=True):
        assert_bitwise(a, b)
    assert model.lm_head.weight is model.wte.weight
    assert_tree_bitwise(model.state_dict(), ref_model.state_dict())
    assert_tree_bitwise(optimizer.state_dict(), ref_opt.state_dict())
    assert optimizer.loss_scale == ref_opt.loss_scale


# ------------------------------------------------------------------ Kahan's fp32 value


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_a_half_way_kahan_value_rounds_back_to_its_weight(dtype):
    """``w + c`` half-way between ``w`` (odd) and its neighbour rounds, to nearest even, to the
    neighbour: fp32_state_dict moves it one fp32 ulp toward ``w``, and a resume from it alone
    gets back ``w`` and ``c`` exactly."""
    w = torch.tensor([1.0, 3.0, -0.75, 0.5], dtype=dtype)
    w = torch.nextafter(w, torch.full_like(w, 100.0))  # odd last bits
    up = torch.nextafter(w, torch.full_like(w, 100.0)).float()
    c = ((up - w.float()) / 2).to(dtype)  # exactly half an ulp
    tie = w.float() + c.float()
    assert torch.equal(tie.to(dtype), up.to(dtype))  # the plain sum rounds away from w
    value = kahan_fp32(w, c)
    assert torch.equal(value.to(dtype), w)
    assert torch.equal((value - w.float()).to(dtype), c)
    assert torch.equal(torch.nextafter(value, tie), tie)  # one fp32 ulp from w + c

    model = nn.Linear(4, 1, bias=False)
    model, opt = mixprec.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        mixprec.Recipe("O3", dtype, update="kahan"),
    )
    with torch.no_grad():
        model.weight.copy_(w.view(1, 4))
        opt.updater.compensation[model.weight].copy_(c.view(1, 4))
    exported = mixprec.fp32_state_dict(model, opt)
    assert exported["weight"].dtype == FP32
    fresh = nn.Linear(4, 1, bias=False)
    fresh.load_state_dict(exported)  # before initialize: the residual of the cast is c again
    fresh, fresh_opt = mixprec.initialize(
        fresh,
        torch.optim.SGD(fresh.parameters(), lr=0.1),
        mixprec.Recipe("O3", dtype, update="kahan"),
    )
    assert_bitwise(fresh.weight.detach(), model.weight.detach())
    assert_bitwise(fresh_opt.updater.compensation[fresh.weight], c.view(1, 4))


# ------------------------------------------------------------------ what cannot be exact says so


def _checkpoint(config, form="model.state_dict"):
    model, opt = initialize(*plain(seed=0), config)
    train(model, opt, range(K))
    weights = mixprec.fp32_state_dict(model, opt) if form == "fp32_state_dict" else None
    return model, opt, saved({"model": weights or model.state_dict(), "opt": opt.state_dict()})


def test_a_top_level_entry_is_reported_by_a_plain_load_and_refused_by_the_wrapper():
    """mixprec's state under a top-level key (not a layout mixprec writes) is dropped by torch's
    load_state_dict: initialize says what it rebuilt; the returned optimizer refuses it rather
    than dropping the masters and scalers silently."""
    _, _, ckpt = _checkpoint("O2-fp16")
    inner, own = split_state_dict(ckpt["opt"])
    old = {**inner, "mixprec": own}
    model, plain_opt = plain(seed=7)
    model.load_state_dict(ckpt["model"])
    plain_opt.load_state_dict(old)
    with pytest.warns(UserWarning, match="has no mixprec entry") as record:
        mixprec.initialize(model, plain_opt, "O2", FP16)
    text = str(record[0].message)
    assert "fp32 masters start from the model's 16-bit weights" in text
    assert "loss scale starts at init_scale=65536" in text
    _, fresh = initialize(*plain(seed=7), "O2-fp16")
    with pytest.raises(KeyError, match=r"at the top level.*param_groups\[0\]"):
        fresh.load_state_dict(old)


def test_a_torch_amp_checkpoint_warns_about_the_loss_scale_unless_given():
    model, opt = plain(seed=0)
    loss = mse(model, *DATA[0])
    loss.backward()
    opt.step()
    ckpt = saved({"model": model.state_dict(), "opt": opt.state_dict()})
    for init_scale in (None, 1024.0):
        model, opt = plain(seed=7)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        recipe = mixprec.Recipe("O2", FP16)
        if init_scale is not None:
            recipe = recipe.replace(loss_scale=mixprec.LossScaling(init_scale=init_scale))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = mixprec.initialize(model, opt, recipe)
        said = [str(w.message) for w in caught if "no mixprec entry" in str(w.message)]
        if init_scale is None:  # fp32 weights: the masters are exact, only the scale restarts
            assert len(said) == 1 and "masters" not in said[0]
            assert "init_scale=ckpt['scaler']['scale']" in said[0]
        else:
            assert said == [] and opt.loss_scale == init_scale


def _assert_model_values_won(model, opt, values, config) -> None:
    exported = mixprec.fp32_state_dict(model, opt)
    for name, value in values.items():
        if config.startswith("O2"):
            assert_bitwise(exported[name], value)  # the masters are the model's values
        else:  # w + c: the loaded value, up to the 16-bit rounding of c
            assert torch.equal(exported[name].to(BF16), value.to(BF16))
            torch.testing.assert_close(exported[name], value, rtol=2**-15, atol=0)


@pytest.mark.parametrize("order", ["load-then-initialize", "initialize-then-load"])
@pytest.mark.parametrize("config", ["O2-bf16", "O3-bf16-kahan"])
def test_a_stale_entry_is_reported_and_ignored(config, order):
    """A plain fp32 optimizer loaded the checkpoint and trained on; its group kept mixprec's
    entry, now stale, and saved it again. Resuming from that, in either order, the masters
    follow the model's weights (not the old masters), and mixprec says so."""
    _, _, ckpt = _checkpoint(config, form="fp32_state_dict")
    model, opt = plain(seed=7)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for t in range(2):
        mse(model, *DATA[t]).backward()
        opt.step()
        opt.zero_grad()
    assert "mixprec" in opt.param_groups[0]
    later = saved({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = plain(seed=7)
    stale = "stepped without mixprec after loading it"
    if order == "load-then-initialize":
        model.load_state_dict(later["model"])
        opt.load_state_dict(later["opt"])
        with pytest.warns(UserWarning, match=stale):
            model, opt = initialize(model, opt, config)
    else:
        model, opt = initialize(model, opt, config)
        model.load_state_dict(later["model"])
        with pytest.warns(UserWarning, match=stale):
            opt.load_state_dict(later["opt"])
    _assert_model_values_won(model, opt, later["model"], config)
    assert opt.loss_scale == 16.0 and opt.skipped_steps == 0  # the entry's scalers: ignored


@pytest.mark.parametrize("config", ["O2-bf16", "O3-bf16-kahan"])
def test_state_of_other_weights_is_reported_and_the_model_wins(config):
    """The model comes from another run's checkpoint than the optimizer state loaded before
    initialize: the masters (compensation) follow the model, loudly."""
    _, _, ckpt = _checkpoint(config, form="fp32_state_dict")
    model, opt = initialize(*plain(seed=3), config)
    train(model, opt, range(2))
    other = saved(mixprec.fp32_state_dict(model, opt))
    model, opt = plain(seed=7)
    model.load_state_dict(other)
    opt.load_state_dict(ckpt["opt"])
    with pytest.warns(UserWarning, match="do not match the weights the model holds"):
        model, opt = initialize(model, opt, config)
    _assert_model_values_won(model, opt, other, config)
    assert opt.loss_scale == 8.0  # the loss scaler's state still comes from the entry


def test_a_checkpoint_that_cannot_be_carried_is_refused_and_the_entry_given_back():
    """Another level's checkpoint is carried over (tests/core/test_cross_recipe.py); one whose
    masters fit no weight of this model is refused, and the caller's optimizer keeps it."""
    _, _, ckpt = _checkpoint("O2-bf16")
    own = ckpt["opt"]["param_groups"][0]["mixprec"]
    own["masters"][0] = torch.zeros(3, 5)  # a master of no weight here
    model, opt = plain(seed=7)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    with pytest.raises(ValueError, match="4 master weights, this optimizer has 0"):
        initialize(model, opt, "O3-bf16-kahan")
    entry = split_state_dict(ckpt["opt"])[1]
    assert_tree_bitwise(opt.param_groups[0]["mixprec"], entry)
    assert len(opt.state) == len(ckpt["opt"]["state"])
