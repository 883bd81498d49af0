"""mixprec.amp: torch.amp's traps, fixed, and what mixprec adds to it (the conformance suite,
torch.amp's own behaviour checked on both namespaces, is tests/amp/conformance/; the recipe loop
is tests/amp/test_pytorch_recipe_loop.py).

Where a test shows a trap, it runs against torch.amp too, marked as an expected failure there:
proof that the test can fail and that torch still has the trap."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.amp as amp

INF = float("inf")
TRAP = pytest.mark.xfail(strict=True, reason="torch.amp has this trap")
BOTH = pytest.mark.parametrize(
    "A", [pytest.param(torch.amp, marks=TRAP, id="torch.amp"), pytest.param(amp, id="mixprec")]
)


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def one_step(scaler, model, opt, inject: float | None = None, dtype=torch.float16) -> None:
    x, y = data()
    with amp.autocast("cpu", dtype):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if inject is not None:
        model[0].weight.grad.view(-1)[0] = inject
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


# -- torch's stage rules, errors and messages, unchanged ------------------------------------------
def _misuse(A, case: str) -> None:
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = A.GradScaler("cpu")
    if case == "step without scale":
        scaler.step(opt)
    loss = F.mse_loss(model(data()[0]), data()[1])
    if case == "fp16 grads":
        model.half()
        loss = F.mse_loss(model(data()[0].half()).float(), data()[1])
    scaler.scale(loss).backward()
    if case == "no grads":
        opt.zero_grad()
    if case in ("unscale twice", "unscale after step"):
        if case == "unscale after step":
            scaler.step(opt)
        scaler.unscale_(opt)
        scaler.unscale_(opt)
    if case == "update without step":
        scaler.update()
    if case == "pickle mid-iteration":
        scaler.unscale_(opt)
        pickle.dumps(scaler)
    if case == "load empty":
        scaler.load_state_dict({})
    scaler.step(opt)
    scaler.step(opt)  # "step twice"


MISUSES = {
    "unscale twice": (RuntimeError, r"unscale_\(\) has already been called on this optimizer"),
    "unscale after step": (RuntimeError, r"unscale_\(\) is being called after step\(\)"),
    "step twice": (RuntimeError, r"step\(\) has already been called since the last update"),
    "step without scale": (AssertionError, "Attempted step but _scale is None"),
    "update without step": (AssertionError, "No inf checks were recorded prior to update"),
    "no grads": (AssertionError, "No inf checks were recorded for this optimizer"),
    "fp16 grads": (ValueError, "Attempting to unscale FP16 gradients"),
    "load empty": (RuntimeError, "The source state dict is empty"),
    "pickle mid-iteration": (AssertionError, "may only be pickled at the beginning"),
}


@pytest.mark.parametrize("A", [torch.amp, amp], ids=["torch.amp", "mixprec"])
@pytest.mark.parametrize("case", list(MISUSES))
def test_misuse_raises_torchs_exception_and_message(A, case):
    error, message = MISUSES[case]
    with pytest.raises(error, match=message):
        _misuse(A, case)


# -- traps ------------------------------------------------------------------------------------
def lbfgs_run(A, scale: float | None, steps: int = 3, positional: bool = True):
    """LBFGS with a closure; ``scale`` None is the plain fp32 reference without a scaler."""
    model = tiny()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=4, history_size=5)
    x, y = data()
    scaler = A.GradScaler("cpu", init_scale=scale) if scale else None
    seen = []

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        return loss

    def spy(optimizer, args, kwargs):  # the gradients LBFGS leaves after its evaluations
        seen.append([p.grad.clone() for p in model.parameters()])

    handle = opt.register_step_post_hook(spy)
    if scaler is not None:
        closure()  # the scale exists before the first step (torch needs it)
    for _ in range(steps):
        if scaler is None:
            opt.step(closure)
        elif positional:
            scaler.step(opt, closure)
            scaler.update()
        else:
            scaler.step(opt, closure=closure)
            scaler.update()
    handle.remove()
    return [p.detach().clone() for p in model.parameters()], seen


@BOTH
def test_lbfgs_with_a_positional_closure_steps_on_unscaled_gradients(A):
    ref_params, ref_grads = lbfgs_run(None, None)
    params, grads = lbfgs_run(A, 2.0**10)
    for step_ref, step in zip(ref_grads, grads):
        for r, g in zip(step_ref, step):
            assert torch.equal(r, g)  # 2**10 unscales exactly
    for r, p in zip(ref_params, params):
        assert torch.equal(r, p)


def test_a_closure_passed_by_keyword_works_too():
    ref_params, _ = lbfgs_run(None, None)
    params, _ = lbfgs_run(amp, 2.0**10, positional=False)
    assert all(torch.equal(r, p) for r, p in zip(ref_params, params))


def test_torch_refuses_a_keyword_closure_that_mixprec_accepts():
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        lbfgs_run(torch.amp, 2.0**10, steps=1, positional=False)


@pytest.mark.parametrize("when", ["first", "later"])
def test_a_non_finite_closure_evaluation_skips_the_step_and_restores_the_weights(when):
    model = tiny()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=4)
    x, y = data()
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    calls = []

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        calls.append(1)
        if len(calls) == (1 if when == "first" else 3):
            model[0].weight.grad.view(-1)[0] = INF
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(opt, closure) is None
    scaler.update()
    assert len(calls) == (1 if when == "first" else 3)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert scaler.step_skipped and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**9


@BOTH
def test_a_disabled_scalers_getters_answer(A):
    scaler = A.GradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, enabled=False)
    assert scaler.get_growth_factor() == 3.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 2000
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@BOTH
def test_is_autocast_available_answers_false_for_a_device_that_does_not_exist(A):
    assert A.is_autocast_available("cpu")
    assert not A.is_autocast_available("not a real device")


def test_is_autocast_available_refuses_a_device_object_with_the_fix():
    with pytest.raises(TypeError, match=r"pass device\.type"):
        amp.is_autocast_available(torch.device("cpu"))


def bf16_warnings(A, *, grads_bf16: bool = False, dtype=torch.bfloat16) -> list[str]:
    model = tiny()
    if grads_bf16:
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = A.GradScaler("cpu")
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with A.autocast("cpu", dtype):
                loss = F.mse_loss(model(x.to(model[0].weight.dtype)).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return [
        str(w.message) for w in caught if "bfloat16 has float32's exponent range" in str(w.message)
    ]


@BOTH
def test_a_scaler_used_with_bfloat16_says_so_once(A):
    assert len(bf16_warnings(A)) == 1


def test_bfloat16_gradients_are_noticed_too_and_float16_says_nothing():
    (msg,) = bf16_warnings(amp, grads_bf16=True, dtype=torch.float16)  # unscale_ in step()
    assert "gradients it unscales are bfloat16" in msg
    assert bf16_warnings(amp, dtype=torch.float16) == []


def test_regions_entered_before_the_scaler_existed_do_not_count():
    with amp.autocast("cpu", torch.bfloat16):
        torch.ones(1)
    model = tiny()
    scaler = amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(F.mse_loss(model(data()[0]), data()[1])).backward()


# -- the scale rule ---------------------------------------------------------------------------
def scales(scaler: amp.GradScaler, verdicts: list[bool]) -> list[float]:
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = []
    for bad in verdicts:
        one_step(scaler, model, opt, INF if bad else None)
        out.append(scaler.get_scale())
    return out


def test_by_default_the_scale_follows_torchs_rule_below_one_too():
    ours = scales(amp.GradScaler("cpu", init_scale=2.0), [True] * 4)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0)
    model, opt = tiny(), torch.optim.SGD(tiny().parameters(), lr=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ref = []
    for _ in range(4):
        one_step(theirs, model, opt, INF)
        ref.append(theirs.get_scale())
    assert ours == ref == [1.0, 0.5, 0.25, 0.125]


def test_hysteresis_backs_off_after_consecutive_overflows_only():
    scaler = amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100, hysteresis=2)
    got = scales(scaler, [True, False, True, True, True, True])
    assert got == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**8]
    assert scaler.skipped_steps == 5 and scaler.step_skipped


def test_min_and_max_scale_bound_the_scale():
    low = amp.GradScaler("cpu", init_scale=4.0, min_scale=1.0)
    assert scales(low, [True] * 4) == [2.0, 1.0, 1.0, 1.0]
    high = amp.GradScaler("cpu", init_scale=8.0, growth_interval=1, max_scale=16.0)
    assert scales(high, [False] * 3) == [16.0] * 3


def test_the_extras_are_validated_with_the_fix_even_on_a_disabled_scaler():
    with pytest.raises(ValueError, match="min_scale must be"):
        amp.GradScaler("cpu", min_scale=0.0, enabled=False)
    with pytest.raises(TypeError, match="hysteresis must be an int"):
        amp.GradScaler("cpu", hysteresis=1.5)
    with pytest.raises(ValueError, match="outside"):
        amp.GradScaler("cpu", init_scale=2.0**16, max_scale=2.0**10)
    with pytest.raises(TypeError, match="process_group must be"):
        amp.GradScaler("cpu", process_group="world")


def test_the_extras_survive_state_dict_pickle_and_a_torch_scaler_in_between():
    a = amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100, hysteresis=3)
    scales(a, [True, True])  # two overflows: hysteresis 3 -> 1 left, no back-off yet
    state = a.state_dict()
    assert state["mixprec"] == {"hysteresis_tracker": 1, "skipped_steps": 2}
    b = amp.GradScaler("cpu", hysteresis=3)
    b.load_state_dict(state)
    c = pickle.loads(pickle.dumps(a))
    for s in (a, b, c):
        assert scales(s, [True]) == [2.0**9]  # the third overflow backs off on every copy
        assert s.skipped_steps == 3
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)  # torch ignores the extra key
    assert theirs.get_scale() == 2.0**10


def test_skip_counts_stay_with_the_default_rule_on_the_device():
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    assert scaler.step_skipped is None and scaler.skipped_steps == 0
    scales(scaler, [False, True, False, True])
    assert scaler.skipped_steps == 2 and scaler.step_skipped is True
    assert "mixprec" not in scaler.state_dict()  # torch's five keys, unless extras are on
    assert amp.GradScaler("cpu", enabled=False).step_skipped is False


def test_a_skipped_step_can_report_which_gradients_held_inf():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=2.0**10, locate_nonfinite=model)
    with pytest.warns(RuntimeWarning, match=r"0\.weight: float32\[8, 4\], 1 inf, 0 nan") as rec:
        one_step(scaler, model, opt, INF)
    assert "1 of 4 gradients" in str(rec[0].message)
    assert "the scale backs off" in scaler.last_skip_report
    with pytest.warns(RuntimeWarning, match="0 inf, 1 nan") as rec:
        one_step(scaler, model, opt, float("nan"))
    assert rec[0].filename == __file__  # points at the caller's scaler.step
    assert "mixprec.numerics.locate_nonfinite(model, scaler)" in scaler.last_skip_report
    plain = amp.GradScaler("cpu", init_scale=2.0**10)  # off by default: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_step(plain, model, opt, INF)
    assert plain.last_skip_report is None


def test_locate_nonfinite_accepts_the_scaler_for_the_loss_scale_and_the_skip():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = data()
    x[0, 0] = INF
    with mixprec.numerics.locate_nonfinite(model, scaler) as loc:
        one_step(scaler, model, opt)
        with amp.autocast("cpu", torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        model(data()[0])  # the next step's forward records the verdict
    (event,) = loc.events
    assert event.op == "<model input>" and event.step == 1
    assert event.loss_scale == 2.0**10 and event.step_skipped is True


# -- autocast -----------------------------------------------------------------------------------
def dtypes_in(region) -> tuple[torch.dtype, ...]:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with region:
        h = lin(x)
        return h.dtype, h.softmax(-1).dtype, F.layer_norm(h, (4,)).dtype, h.exp().dtype


def test_autocast_is_torchs_by_default_and_mixprecs_table_on_request():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes_in(amp.autocast("cpu", bf16)) == dtypes_in(torch.autocast("cpu", bf16))
    assert dtypes_in(amp.autocast("cpu", bf16)) == (bf16, bf16, bf16, bf16)
    assert dtypes_in(amp.autocast("cpu", bf16, cast_rules="mixprec")) == (bf16, fp32, fp32, fp32)
    overrides = {torch.softmax: "lower", "exp": None}
    assert dtypes_in(amp.autocast("cpu", bf16, cast_rules=overrides)) == (bf16, bf16, fp32, bf16)
    assert isinstance(amp.autocast("cpu", cast_rules="mixprec"), torch.autocast)


def test_cast_rules_apply_to_this_device_type_only_and_are_checked():
    with amp.autocast("cpu", torch.bfloat16, cast_rules="mixprec"):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    with pytest.raises(ValueError, match="cast_rules must be None"):
        amp.autocast("cpu", cast_rules="fp32")
    with pytest.raises(ValueError, match=r"is not a rule; use one of \('lower', 'fp32'"):
        amp.autocast("cpu", cast_rules={torch.softmax: "float32"})
    with pytest.raises(ValueError, match="needs device_type 'cpu' or 'cuda'"):
        amp.autocast("xpu", cast_rules="mixprec")


@BOTH
def test_a_region_nested_in_another_dtype_gets_its_own_weight_casts(A):
    def nest(A, **kw):
        lin = nn.Linear(4, 4)
        x = torch.randn(2, 4)
        with A.autocast("cpu", torch.bfloat16, **kw):
            a = lin(x).dtype
            with A.autocast("cpu", torch.float16, **kw):
                b = lin(x).dtype
                with A.autocast("cpu", enabled=False):
                    c = lin(x).dtype
            d = lin(x).dtype
        return a, b, c, d, torch.is_autocast_enabled("cpu")

    expected = (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, False)
    assert nest(A) == expected
    assert nest(amp, cast_rules="mixprec") == expected


def test_cast_rules_compile_to_the_same_dtypes_as_eager():
    lin = nn.Linear(4, 4)

    def f(x):
        with amp.autocast("cpu", torch.bfloat16, cast_rules="mixprec"):
            return lin(x).softmax(-1)

    x = torch.randn(2, 4)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert compiled.dtype == f(x).dtype == torch.float32
    assert torch.equal(compiled, f(x))


def test_a_table_region_with_overrides_refuses_to_be_compiled_with_the_fix():
    def f(x):
        with amp.autocast("cpu", torch.bfloat16, cast_rules={torch.softmax: "lower"}):
            return x.softmax(-1)

    with pytest.raises(Exception, match="register_op"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(2, 4))


def test_the_scaler_and_autocast_are_torchs_classes():
    assert issubclass(amp.GradScaler, torch.amp.GradScaler)
    assert issubclass(amp.autocast, torch.amp.autocast)
    assert amp.custom_fwd is torch.amp.custom_fwd and amp.custom_bwd is torch.amp.custom_bwd
    assert set(amp.__all__) == set(torch.amp.__all__)
    assert math.isclose(amp.GradScaler("cpu").get_scale(), 2.0**16)
