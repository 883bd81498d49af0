"""GradScaler conformance: torch.amp.GradScaler's documented behaviour, checked on the CPU
against ``torch.amp`` (control) and ``mixprec.amp`` (the ``A`` fixture, conftest.py).

The behaviours are those PyTorch's own device-generic grad-scaling tests check (unscaling,
the scale's update rule, state dicts, pickling, the training-loop recipes, fused optimizers,
stage-rule errors); the tests are mixprec's own. Training loops compare a scaled model with an
unscaled control built by torch's wheel helper ``_create_scaling_case`` (two equal
``Linear(8, 8)`` stacks, four batches, an inf injected at iteration ``skip_iter`` = 2)."""

from __future__ import annotations

import inspect
import io
import math
import pickle
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_
from torch.testing import assert_close
from torch.testing._internal.common_cuda import (
    _create_scaling_case,
    _create_scaling_models_optimizers,
)

import mixprec.amp

INF, NAN = float("inf"), float("nan")
NAMESPACES = {"torch.amp": torch.amp, "mixprec.amp": mixprec.amp}
# optimizer flavours: the per-parameter loop, the multi-tensor (foreach) path and the fused kernel
FLAVOURS = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# the optimizers that have a fused CPU kernel in torch 2.13
FUSED_ON_CPU = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad]


def exactly(message: str) -> str:
    """A ``pytest.raises(match=)`` pattern that accepts ``message`` and nothing else."""
    return "^" + re.escape(message) + "$"


def scaling_case(optimizer=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    return _create_scaling_case("cpu", optimizer_ctor=optimizer, optimizer_kwargs=kwargs or None)


def assert_same_training(models, opts, atol: float = 1e-7, rtol: float = 0.0) -> None:
    """Gradients, parameters and optimizer state of the control (first) and the scaled run."""
    (control, scaled), (opt_c, opt_s) = models, opts
    for pc, ps in zip(control.parameters(), scaled.parameters()):
        assert (pc.grad is None) == (ps.grad is None)
        if pc.grad is not None:
            assert_close(ps.grad, pc.grad, atol=atol, rtol=rtol)
        assert_close(ps, pc, atol=atol, rtol=rtol)
        state_c, state_s = opt_c.state[pc], opt_s.state[ps]
        assert state_c.keys() == state_s.keys()
        for key, value in state_c.items():
            if isinstance(value, torch.Tensor):
                assert_close(state_s[key], value, atol=atol, rtol=rtol)
            else:
                assert state_s[key] == value


def expected_scale(enabled: bool, unskipped: int, skipped: int) -> float:
    """The scale after the loops below: init 128, growth 2 each clean step, backoff 0.5."""
    return 128.0 * 2.0**unskipped * 0.5**skipped if enabled else 1.0


def run_against_control(
    A,
    loop,
    *,
    enabled: bool,
    unskipped: int,
    skipped: int,
    atol=1e-7,
    optimizer=torch.optim.SGD,
    **kwargs,
) -> None:
    """``loop`` once without a scaler (the control, which skips the step the scaled run skips)
    and once with ``A.GradScaler(init_scale=128, growth_interval=1)``; then compare."""
    mod_c, mod_s, opt_c, opt_s, data, loss_fn, skip_iter = scaling_case(optimizer, **kwargs)
    scaler = A.GradScaler(
        "cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled
    )
    skip = skip_iter if enabled else None  # a disabled scaler would step on the inf: none injected
    loop(A, data, mod_c, opt_c, None, loss_fn, skip)
    scaler = loop(A, data, mod_s, opt_s, scaler, loss_fn, skip)
    assert scaler.get_scale() == expected_scale(enabled, unskipped, skipped)
    assert scaler.is_enabled() == enabled
    assert_same_training((mod_c, mod_s), (opt_c, opt_s), atol=atol)


def finish(scaler, model, opt, i: int, skip) -> None:
    """The scaled run's end of an iteration; an inf in the last layer's gradient at ``skip``."""
    if i == skip:
        model[1].weight.grad.fill_(INF)
    scaler.step(opt)
    scaler.update()


# -- unscaling -------------------------------------------------------------------------------------
def grads_of_every_layout():
    """Parameters whose gradients of 4.0 are contiguous, transposed (dense, not contiguous) and
    sliced (not dense): the multi-tensor kernel and its per-tensor fallback."""
    params = [nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    params.append(nn.Parameter(torch.zeros(4, 3)))
    params[0].grad = torch.full((4, 4), 4.0)
    params[1].grad = torch.full((4, 4), 4.0).t()
    params[2].grad = torch.full((4, 6), 4.0)[:, :3]
    assert not params[1].grad.is_contiguous() and not params[2].grad.is_contiguous()
    return params


@pytest.mark.parametrize(
    "bad",
    [None, *((i, v) for v in (INF, NAN) for i in range(3))],
    ids=lambda b: "finite" if b is None else f"{b[1]}-in-grad{b[0]}",
)
def test_unscale_divides_every_gradient_and_any_inf_or_nan_skips_the_step(A, bad):
    params = grads_of_every_layout()
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = A.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    scaler.scale(torch.ones(()))  # the scale tensor is made lazily, by the first scale()
    if bad is not None:
        params[bad[0]].grad[1, 2] = bad[1]
    scaler.unscale_(opt)
    if bad is None:
        for p in params:
            assert_close(p.grad, torch.ones_like(p), atol=1e-7, rtol=0)
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    moved = [not torch.equal(b, p) for b, p in zip(before, params)]
    assert moved == [bad is None] * 3
    assert scaler.get_scale() == (8.0 if bad is None else 2.0)


@pytest.mark.parametrize("bad", [None, 0, 1, 2, 3, 4], ids=lambda b: f"inf-in-grad{b}")
def test_unscale_grads_over_mixed_dtypes_and_layouts_finds_an_inf_anywhere(A, bad):
    """The private ``_unscale_grads_`` hook (which fused optimizers and sharded scalers call with
    ``allow_fp16=True``): fp32 and fp16 gradients, contiguous or not, in one optimizer."""
    shapes = [(4, 4), (4, 4), (4, 3), (4, 3), (4, 4)]
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float16, torch.float16]
    params = [nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for i, p in enumerate(params):
        if i in (2, 3):
            p.grad = torch.full((4, 6), 4.0, dtype=p.dtype)[:, :3]
        elif i == 4:
            p.grad = torch.full((4, 4), 4.0, dtype=p.dtype).t()
        else:
            p.grad = torch.full((4, 4), 4.0, dtype=p.dtype)
    if bad is not None:
        params[bad].grad[0, 1] = INF
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = A.GradScaler("cpu")
    found = scaler._unscale_grads_(opt, torch.tensor(0.25), torch.zeros(()), True)
    assert list(found) == [torch.device("cpu")]
    assert found[torch.device("cpu")].item() == (0.0 if bad is None else 1.0)
    if bad is None:
        for p in params:
            assert torch.equal(p.grad, torch.ones_like(p))


def sparse_grad(values, indices=((0, 1, 1), (2, 0, 2)), dtype=torch.float32):
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values, dtype=dtype), (2, 3), check_invariants=True
    )


@pytest.mark.parametrize("value", [None, INF, NAN], ids=["finite", "inf", "nan"])
def test_sparse_gradients_are_unscaled_and_checked(A, value):
    p = nn.Parameter(torch.zeros(2, 3))
    values = [16.0, 32.0, 64.0 if value is None else value]
    p.grad = sparse_grad(values)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = A.GradScaler("cpu", init_scale=2.0, growth_interval=1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    assert p.grad.is_sparse
    if value is None:
        assert torch.equal(p.grad.to_dense(), torch.tensor([[0.0, 0, 8], [16, 0, 32]]))
    scaler.step(opt)
    scaler.update()
    assert p.detach().abs().sum().item() == (56.0 if value is None else 0.0)
    assert scaler.get_scale() == (4.0 if value is None else 1.0)


@pytest.mark.parametrize(
    ("indices", "values", "found"),
    [
        (((0, 1, 1), (2, 0, 2)), [16.0, 32.0, 64.0], 0.0),
        (((0, 1, 1), (2, 0, 2)), [16.0, INF, 64.0], 1.0),
        # duplicate indices, each value finite: coalescing sums them to 128000, over fp16's max
        (((1, 1), (0, 0)), [64000.0, 64000.0], 1.0),
    ],
    ids=["finite", "inf", "overflow-when-coalesced"],
)
def test_fp16_sparse_gradients_are_coalesced_before_they_are_checked(A, indices, values, found):
    p = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    p.grad = sparse_grad(values, indices, torch.float16)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = A.GradScaler("cpu")
    flags = scaler._unscale_grads_(opt, torch.tensor(0.5), torch.zeros(()), True)
    assert flags[torch.device("cpu")].item() == found
    if not found:
        expected = torch.tensor([[0.0, 0, 8], [16, 0, 32]], dtype=torch.float16)
        assert torch.equal(p.grad.to_dense(), expected)


# -- the scale's update rule -----------------------------------------------------------------------
def toy_step(scaler, bad: bool = False, p: nn.Parameter | None = None) -> None:
    """One scale/backward/step/update on a toy parameter; ``bad`` writes an inf into its grad."""
    p = nn.Parameter(torch.ones(3)) if p is None else p
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(p.sum()).backward()
    if bad:
        p.grad[0] = INF
    scaler.step(opt)
    scaler.update()


def tracker(scaler) -> int:
    return scaler.state_dict()["_growth_tracker"]


def test_update_grows_after_growth_interval_clean_steps_and_backs_off_on_inf(A):
    scaler = A.GradScaler(
        "cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2
    )
    seen = []
    for bad in (False, False, True, False, True, False, False):
        toy_step(scaler, bad)
        seen.append((scaler.get_scale(), tracker(scaler)))
    # a clean step counts; the interval's last one grows and resets the count; an inf backs off
    # and resets the count too
    assert seen == [(4.0, 1), (8.0, 0), (2.0, 0), (2.0, 1), (0.5, 0), (0.5, 1), (1.0, 0)]


def test_setters_change_the_rule_from_the_next_update(A):
    scaler = A.GradScaler("cpu", init_scale=4.0, growth_interval=3)
    toy_step(scaler)
    scaler.set_growth_interval(2)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.125)
    assert (scaler.get_growth_interval(), scaler.get_growth_factor()) == (2, 3.0)
    assert scaler.get_backoff_factor() == 0.125
    toy_step(scaler)
    assert (scaler.get_scale(), tracker(scaler)) == (12.0, 0)
    toy_step(scaler, bad=True)
    assert scaler.get_scale() == 1.5


def test_update_takes_a_new_scale_as_a_float_or_a_one_element_tensor(A):
    scaler = A.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.update(16.0)  # no step needed: the scale is set, not computed
    assert scaler.get_scale() == 16.0
    new = torch.tensor(32.0)
    scaler.update(new)
    new.fill_(1.0)  # copied, not kept
    assert scaler.get_scale() == 32.0
    toy_step(scaler, bad=True)
    assert scaler.get_scale() == 16.0


def test_a_growth_that_would_overflow_float32_is_not_taken(A):
    scaler = A.GradScaler("cpu", init_scale=1e38, growth_factor=2.0**4, growth_interval=1)
    p = nn.Parameter(torch.full((2,), 0.5))
    toy_step(scaler, p=p)  # gradient 0.5 * 1e38: finite
    assert math.isfinite(scaler.get_scale())
    assert scaler.get_scale() == torch.tensor(1e38).item()  # float32's 1e38, not grown


# -- state_dict and pickling -----------------------------------------------------------------------
def trained(A, **kwargs):
    """A scaler after two clean steps and an inf (scale 2 -> 4 -> 2, tracker 0 -> 1 -> 0 ...)."""
    scaler = A.GradScaler("cpu", **kwargs)
    for bad in (False, True, False):
        toy_step(scaler, bad)
    return scaler


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "initialized"])
def test_state_dict_round_trip(A, lazy):
    s0 = A.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
    )
    if not lazy:
        toy_step(s0)  # scale 3, tracker 1
    s1 = A.GradScaler(
        "cpu", init_scale=6.0, growth_factor=5.0, backoff_factor=0.8, growth_interval=1
    )
    if not lazy:
        s1.scale(torch.ones(()))  # s1's scale tensor exists: loading must fill it
    state = s0.state_dict()
    assert state == {
        "scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 0 if lazy else 1,
    }
    s1.load_state_dict(state)
    assert s1.state_dict() == state
    assert s1.get_scale() == 3.0 and s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5 and s1.get_growth_interval() == 2
    assert torch.equal(s1.scale(torch.ones(())), torch.tensor(3.0))
    toy_step(s1)  # the loaded tracker counts on: lazy 0 -> 1; initialized 1 -> growth
    assert (s1.get_scale(), tracker(s1)) == ((3.0, 1) if lazy else (12.0, 0))


@pytest.mark.parametrize("src", list(NAMESPACES))
@pytest.mark.parametrize("dst", list(NAMESPACES))
def test_state_dicts_load_across_torch_amp_and_mixprec_amp_and_through_torch_save(src, dst):
    source = trained(NAMESPACES[src], init_scale=2.0, growth_interval=2)
    state = source.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # plain Python values: safe to load
    target = NAMESPACES[dst].GradScaler("cpu")
    target.load_state_dict(loaded)
    assert target.state_dict() == state
    for bad in (False, False, True):  # from here on both follow the same rule
        toy_step(source, bad)
        toy_step(target, bad)
        assert target.state_dict() == source.state_dict()


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "initialized"])
def test_pickle_round_trip(A, enabled, lazy):
    scaler = A.GradScaler(
        "cpu",
        init_scale=4.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=5,
        enabled=enabled,
    )
    if not lazy:
        toy_step(scaler)
    copy = pickle.loads(pickle.dumps(scaler))
    assert type(copy) is type(scaler)
    assert copy.is_enabled() == enabled
    assert copy.state_dict() == scaler.state_dict()
    if not enabled:
        assert copy.state_dict() == {} and copy.get_scale() == 1.0
        return
    assert copy._scale is None  # tensors are rebuilt lazily from the pickled floats
    assert (copy.get_growth_factor(), copy.get_backoff_factor()) == (3.0, 0.25)
    assert copy.get_growth_interval() == 5
    for s in (scaler, copy):  # and both go on alike
        toy_step(s)
    assert (
        copy.state_dict()
        == scaler.state_dict()
        == {
            "scale": 4.0,
            "growth_factor": 3.0,
            "backoff_factor": 0.25,
            "growth_interval": 5,
            "_growth_tracker": 1 if lazy else 2,
        }
    )


# -- the loop recipes against an unscaled control --------------------------------------------------
@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("optimizer", FUSED_ON_CPU, ids=lambda o: o.__name__)
def test_training_under_autocast_matches_the_unscaled_control(A, optimizer, flavour):
    """float16 autocast, scaled vs. unscaled: the scaling (powers of two) must not change a
    step; the scaler is pickled and restored after every update, as a checkpoint would."""

    def loop(A, data, model, opt, scaler, loss_fn, skip):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with A.autocast("cpu", torch.float16):
                loss = loss_fn(model(x), y)
            assert loss.dtype == torch.float32  # mse_loss is on the CPU's float32 list
            if scaler is None:
                loss.backward()
                if i != skip:
                    opt.step()
                continue
            scaler.scale(loss).backward()
            finish(scaler, model, opt, i, skip)
            scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    for enabled in (True, False):
        run_against_control(
            A,
            loop,
            enabled=enabled,
            unskipped=3,
            skipped=1,
            atol=1e-6,
            optimizer=optimizer,
            **FLAVOURS[flavour],
        )


MAX_NORM = 0.2


def loop_clipping(A, data, model, opt, scaler, loss_fn, skip):
    """Clipping the scaled gradients to ``max_norm`` times the scale, no ``unscale_``."""
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            clip_grad_norm_(model.parameters(), MAX_NORM)
            if i != skip:
                opt.step()
            continue
        scaler.scale(loss).backward()
        if i == skip:
            model[1].weight.grad.fill_(INF)
        clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    return scaler


def loop_clipping_unscaled(A, data, model, opt, scaler, loss_fn, skip):
    """``unscale_``, then clipping the true gradients, then ``step`` (which does not unscale
    again)."""
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            clip_grad_norm_(model.parameters(), MAX_NORM)
            if i != skip:
                opt.step()
            continue
        scaler.scale(loss).backward()
        if i == skip:
            model[1].weight.grad.fill_(INF)
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=False)
        scaler.step(opt)
        scaler.update()
    return scaler


def loop_penalty(A, data, model, opt, scaler, loss_fn, skip):
    """A gradient penalty: ``autograd.grad`` of the scaled loss, unscaled by hand."""
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        params = list(model.parameters())
        if scaler is None:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        else:
            scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled]
        loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        if scaler is None:
            loss.backward()
            if i != skip:
                opt.step()
            continue
        scaler.scale(loss).backward()
        finish(scaler, model, opt, i, skip)
    return scaler


def loop_accumulation(A, data, model, opt, scaler, loss_fn, skip):
    """Two micro-batches per step: one update per step, none per micro-batch."""
    for i, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y) / 2
        (loss if scaler is None else scaler.scale(loss)).backward()
        if i % 2 == 1:
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    return scaler


RECIPES = {
    "clipping": (loop_clipping, 3, 1, 1e-6),
    "clipping-after-unscale": (loop_clipping_unscaled, 3, 1, 1e-7),
    "penalty": (loop_penalty, 3, 1, 1e-6),
    "accumulation": (loop_accumulation, 2, 0, 1e-7),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_matches_the_unscaled_control(A, recipe):
    loop, unskipped, skipped, atol = RECIPES[recipe]
    for enabled in (True, False):
        run_against_control(
            A, loop, enabled=enabled, unskipped=unskipped, skipped=skipped, atol=atol
        )


def test_two_models_two_optimizers_two_losses_one_scaler(A):
    """Both losses backpropagate into both models; ``unscale_`` on one optimizer only; an inf
    in the second model's gradient skips that optimizer's step alone, and the one ``update()``
    backs off."""
    for enabled in (True, False):
        mod_c0, mod_s0, opt_c0, opt_s0, data, loss_fn, skip_iter = scaling_case()
        mod_c1, mod_s1, opt_c1, opt_s1 = _create_scaling_models_optimizers("cpu")
        scaler = A.GradScaler("cpu", init_scale=128.0, growth_interval=1, enabled=enabled)
        skip = skip_iter if enabled else None

        def loop(models, opts, scaler, skip=skip, data=data, loss_fn=loss_fn):
            (m0, m1), (o0, o1) = models, opts
            for i, (x, y) in enumerate(data):
                o0.zero_grad()
                o1.zero_grad()
                out0, out1 = m0(x), m1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if scaler is None:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()
                    if i != skip:
                        o1.step()
                    continue
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip:
                    m1[1].weight.grad.fill_(INF)
                scaler.unscale_(o0)
                scaler.step(o0)
                scaler.step(o1)
                scaler.update()

        loop((mod_c0, mod_c1), (opt_c0, opt_c1), None)
        loop((mod_s0, mod_s1), (opt_s0, opt_s1), scaler)
        assert scaler.get_scale() == expected_scale(enabled, 3, 1)
        assert_same_training((mod_c0, mod_s0), (opt_c0, opt_s0))
        assert_same_training((mod_c1, mod_s1), (opt_c1, opt_s1))


# -- fused optimizers ------------------------------------------------------------------------------
FUSED_CASES = {
    "Adam": (torch.optim.Adam, {}),
    "Adam-amsgrad": (torch.optim.Adam, {"amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "SGD-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {}),
}


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_a_fused_optimizer_steps_as_its_loop_version(A, case, separate_unscale):
    """A fused optimizer unscales and skips inside its kernel (the scaler hands it
    ``grad_scale`` and ``found_inf``); a loop optimizer is unscaled and skipped by the scaler.
    Under autocast, with an inf at iteration 2, both give the same losses, gradients,
    parameters and state (the fused kernel's ``step`` may be a 1-element tensor)."""
    optimizer, kwargs = FUSED_CASES[case]
    kwargs = {"lr": 0.05, **kwargs}
    mod_ref, mod_fused, _, _, data, loss_fn, skip_iter = scaling_case()
    opt_ref = optimizer(mod_ref.parameters(), foreach=False, **kwargs)
    opt_fused = optimizer(mod_fused.parameters(), fused=True, **kwargs)
    runs = []
    for model, opt in ((mod_ref, opt_ref), (mod_fused, opt_fused)):
        scaler = A.GradScaler("cpu", init_scale=128.0, growth_interval=1)
        losses = []
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with A.autocast("cpu", torch.float16):
                loss = loss_fn(model(x), y)
            losses.append(loss.detach())
            scaler.scale(loss).backward()
            if i == skip_iter:
                model[1].weight.grad.fill_(INF)
            if separate_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
        runs.append((losses, scaler.get_scale()))
    assert runs[0][1] == runs[1][1] == expected_scale(True, 3, 1)
    assert_close(runs[1][0], runs[0][0])
    for p_ref, p_fused in zip(mod_ref.parameters(), mod_fused.parameters()):
        assert_close(p_fused.grad, p_ref.grad)
        assert_close(p_fused, p_ref)
        state_ref, state_fused = opt_ref.state[p_ref], opt_fused.state[p_fused]
        assert state_ref.keys() == state_fused.keys()
        for key, value in state_ref.items():
            assert_close(
                torch.as_tensor(state_fused[key]).squeeze(), torch.as_tensor(value).squeeze()
            )


@pytest.mark.parametrize("unscaled_first", [False, True], ids=["ready", "after-unscale"])
@pytest.mark.parametrize("optimizer", FUSED_ON_CPU, ids=lambda o: o.__name__)
def test_a_preset_grad_scale_on_a_fused_optimizer(A, optimizer, unscaled_first):
    """A user who scales the loss by a further factor sets ``optimizer.grad_scale`` to it. The
    scaler multiplies it with its own scale when it steps a fused optimizer, or, after
    ``unscale_``, hands over the user's factor alone; either way the step is the unscaled one,
    and the scaler removes the attribute afterwards."""
    preset = 4.0
    mod_c, mod_s, _, _, data, loss_fn, skip_iter = scaling_case()
    opt_c = optimizer(mod_c.parameters(), lr=0.05, fused=True)
    opt_s = optimizer(mod_s.parameters(), lr=0.05, fused=True)
    scaler = A.GradScaler("cpu", init_scale=128.0, growth_interval=1)
    for i, (x, y) in enumerate(data):
        opt_c.zero_grad()
        opt_s.zero_grad()
        loss_fn(mod_c(x), y).backward()
        if i != skip_iter:
            opt_c.step()
        loss = loss_fn(mod_s(x), y)
        if unscaled_first:
            scaler.scale(loss).backward()
            if i == skip_iter:
                mod_s[1].weight.grad.fill_(INF)
            scaler.unscale_(opt_s)
            for p in mod_s.parameters():
                p.grad.mul_(preset)
        else:
            scaler.scale(loss * preset).backward()
            if i == skip_iter:
                mod_s[1].weight.grad.fill_(INF)
        opt_s.grad_scale = torch.tensor(preset)
        scaler.step(opt_s)
        assert not hasattr(opt_s, "grad_scale")
        scaler.update()
    assert scaler.get_scale() == expected_scale(True, 3, 1)
    for pc, ps in zip(mod_c.parameters(), mod_s.parameters()):
        assert_close(ps, pc, atol=1e-6, rtol=1e-6)
        for key, value in opt_c.state[pc].items():
            assert_close(opt_s.state[ps][key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("value", [INF, NAN], ids=["inf", "nan"])
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_gradients_spoiled_between_unscale_and_step_are_not_checked_again(A, flavour, value):
    """The verdict is taken at ``unscale_``: gradients overwritten afterwards go into the
    step, and the parameters become non-finite (torch documents the check's timing)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **FLAVOURS[flavour])
    scaler = A.GradScaler("cpu", init_scale=128.0)
    scaler.scale(model(torch.randn(2, 4)).pow(2).sum()).backward()
    scaler.unscale_(opt)
    model.weight.grad.fill_(value)
    scaler.step(opt)
    scaler.update()
    assert not torch.isfinite(model.weight).any()
    assert torch.isfinite(model.bias).all()
    assert scaler.get_scale() == 128.0  # the unscale_ verdict was clean: no back-off


# -- the scaler passed to an optimizer that handles scaling itself ---------------------------------
class OwnScalingSGD(torch.optim.SGD):
    """An optimizer that declares ``_step_supports_amp_scaling`` and records what it got."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):  # the scaler hands over grad_scale and found_inf
        self.seen = {"grad_scale": self.grad_scale.clone(), "found_inf": self.found_inf.clone()}
        return "stepped"


class OwnScalingSGDWithKwarg(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # the legacy contract: the scaler itself
        self.seen = {
            "grad_scaler": grad_scaler,
            "attrs": [hasattr(self, "grad_scale"), hasattr(self, "found_inf")],
        }


def test_an_optimizer_that_scales_itself_gets_grad_scale_and_found_inf(A):
    p = nn.Parameter(torch.ones(3))
    opt = OwnScalingSGD([p], lr=0.1)
    scaler = A.GradScaler("cpu", init_scale=8.0)
    scaler.scale(p.sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaler.step(opt) == "stepped"
    assert torch.equal(opt.seen["grad_scale"], torch.tensor(8.0))
    assert torch.equal(opt.seen["found_inf"], torch.tensor(0.0))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert torch.equal(p.grad, torch.full((3,), 8.0))  # the scaler leaves unscaling to it
    scaler.update()


def test_an_optimizer_with_a_grad_scaler_argument_gets_the_scaler_with_a_future_warning(A):
    p = nn.Parameter(torch.ones(3))
    opt = OwnScalingSGDWithKwarg([p], lr=0.1)
    assert "grad_scaler" in inspect.signature(opt.step).parameters
    scaler = A.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(opt)
    assert opt.seen == {"grad_scaler": scaler, "attrs": [False, False]}


# -- the rest of the API ---------------------------------------------------------------------------
def test_scale_multiplies_nested_outputs_and_keeps_their_containers(A):
    scaler = A.GradScaler("cpu", init_scale=2.0)
    t = torch.full((2,), 4.0)
    out = scaler.scale([t, (t, [t.clone()]), t])
    assert type(out) is list and type(out[1]) is tuple and type(out[1][1]) is list
    for v in (out[0], out[1][0], out[1][1][0], out[2]):
        assert torch.equal(v, torch.full((2,), 8.0))
    lazy = scaler.scale(iter([t, t]))  # any other iterable comes back as an iterator
    assert [v.tolist() for v in lazy] == [[8.0, 8.0], [8.0, 8.0]]
    assert scaler._scale.device == t.device and scaler._scale.dtype == torch.float32


def test_step_returns_the_optimizers_value_or_none_when_it_skips(A):
    class Answering(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            return 42.0

    p = nn.Parameter(torch.ones(3))
    opt = Answering([p], lr=0.1)
    scaler = A.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    assert scaler.step(opt) == 42.0
    scaler.update()
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    p.grad[0] = NAN
    assert scaler.step(opt) is None
    scaler.update()


def test_a_disabled_scaler_passes_everything_through(A):
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = A.GradScaler("cpu", enabled=False)
    loss = p.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    scaler.update()
    scaler.load_state_dict({"scale": 8.0})  # ignored
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is usable here")
def test_the_default_cuda_scaler_warns_and_disables_itself_without_cuda(A):
    with pytest.warns(
        UserWarning,
        match=exactly(
            "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
        ),
    ):
        scaler = A.GradScaler()
    assert not scaler.is_enabled()


# -- stage rules: torch's exceptions and messages, exactly -----------------------------------------
_NO_SCALE = (
    "Attempted {} but _scale is None.  This may indicate your script did not use "
    "scaler.scale(loss or outputs) earlier in the iteration."
)
_BAD_NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
    "torch.FloatTensor with requires_grad=False."
)


def _stage(case: str, A) -> None:
    """Set up a one-parameter loop and misuse it as ``case`` says."""
    p = nn.Parameter(torch.ones(3, dtype=torch.float16 if case == "fp16 gradients" else None))
    opt = torch.optim.SGD([p], lr=0.1)
    kwargs = {"growth_factor": 1.0} if case == "growth factor 1" else {}
    kwargs = {"backoff_factor": 1.0} if case == "backoff factor 1" else kwargs
    scaler = A.GradScaler("cpu", **kwargs)
    if case == "step before scale":
        scaler.step(opt)
    if case == "unscale_ before scale":
        scaler.unscale_(opt)
    if case == "update before scale":
        scaler.update()
    if case == "scale a number":
        scaler.scale(3.0)
    scaler.scale(p.float().sum()).backward()
    if case == "optimizer without gradients":
        opt.zero_grad()
    if case == "update without step":
        scaler.update()
    if case.startswith("new_scale"):
        bad = {
            "new_scale of 2 elements": torch.ones(2),
            "new_scale requiring grad": torch.ones((), requires_grad=True),
            "new_scale on another device": torch.ones((), device="meta"),
        }[case]
        scaler.update(bad)
    if case == "empty state dict":
        scaler.load_state_dict({})
    if case == "pickled mid-iteration":
        scaler.unscale_(opt)
        pickle.dumps(scaler)
    if case == "unscale_ after step":
        scaler.step(opt)
    if case in ("unscale_ twice", "unscale_ after step"):
        scaler.unscale_(opt)
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.step(opt)  # "step twice"


STAGE_ERRORS = {
    "unscale_ twice": (
        RuntimeError,
        "unscale_() has already been called on this optimizer since the last update().",
    ),
    "unscale_ after step": (RuntimeError, "unscale_() is being called after step()."),
    "step twice": (RuntimeError, "step() has already been called since the last update()."),
    "step before scale": (AssertionError, _NO_SCALE.format("step")),
    "unscale_ before scale": (AssertionError, _NO_SCALE.format("unscale_")),
    "update before scale": (AssertionError, _NO_SCALE.format("update")),
    "update without step": (AssertionError, "No inf checks were recorded prior to update."),
    "optimizer without gradients": (
        AssertionError,
        "No inf checks were recorded for this optimizer.",
    ),
    "fp16 gradients": (ValueError, "Attempting to unscale FP16 gradients."),
    "empty state dict": (
        RuntimeError,
        "The source state dict is empty, possibly because it was "
        "saved from a disabled instance of GradScaler.",
    ),
    "pickled mid-iteration": (
        AssertionError,
        "A GradScaler instance may only be pickled at the "
        "beginning of an iteration, or at the end after scaler.update().",
    ),
    "growth factor 1": (AssertionError, "The growth factor must be > 1.0."),
    "backoff factor 1": (AssertionError, "The backoff factor must be < 1.0."),
    "scale a number": (ValueError, "outputs must be a Tensor or an iterable of Tensors"),
    "new_scale of 2 elements": (AssertionError, _BAD_NEW_SCALE),
    "new_scale requiring grad": (AssertionError, _BAD_NEW_SCALE),
    "new_scale on another device": (AssertionError, _BAD_NEW_SCALE),
}


@pytest.mark.parametrize("case", list(STAGE_ERRORS))
def test_misuse_raises_torchs_exception_with_torchs_message(A, case):
    error, message = STAGE_ERRORS[case]
    with pytest.raises(error, match=exactly(message)):
        _stage(case, A)
