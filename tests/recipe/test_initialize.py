"""Behavioural tests for mixprec.initialize: levels train, dtypes per level, policies, return
shapes, and every error path (with the model left untouched on error)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn

import mixprec
from mixprec import initialize, scale_loss
from mixprec._core.optimizer import MixedPrecisionOptimizer

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


def regression_data(n: int = 64) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 4, generator=g)


def mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x).float() - y).pow(2).mean()


def model_and_opt(seed: int = 0, lr: float = 0.1):
    m = make_model(seed)
    return m, torch.optim.SGD(m.parameters(), lr=lr)


# ------------------------------------------------------------------ 11. every level trains


def _train(
    level: str, dtype, opt_name: str, steps: int = 50
) -> tuple[float, float, nn.Module, MixedPrecisionOptimizer]:
    x, y = regression_data()
    model = make_model()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if opt_name == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=3e-3)
    )
    model, opt = initialize(model, opt, level, dtype)
    with torch.no_grad():
        first = mse(model, x, y).item()
    for _ in range(steps):
        loss = mse(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        assert not opt.step_skipped
    with torch.no_grad():
        out = model(x)
        last = (out.float() - y).pow(2).mean().item()
    if level != "O0":
        assert out.dtype == FP32  # outputs are cast back at O1-O3
    return first, last, model, opt


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_every_level_trains_and_matches_fp32(opt_name):
    ref_first, ref_last, *_ = _train("O0", None, opt_name)
    assert math.isfinite(ref_last) and ref_last < 0.5 * ref_first
    for level in ("O1", "O2", "O3"):
        first, last, model, opt = _train(level, BF16, opt_name)
        assert math.isfinite(last) and last < 0.5 * first, level
        # Measured: O1/O2 end within 0.2% of the fp32 loss (~0.15-0.17 after 50 steps, far from
        # convergence so the relative gap is not inflated by a tiny denominator); 2% is a 10x
        # margin yet catches a missing master copy or a wrong unscale. O3 updates bf16 weights
        # directly (updates below half a bf16 ulp are lost) and measured ~3% off: 10%.
        rel = 0.02 if level in ("O1", "O2") else 0.10
        assert last == pytest.approx(ref_last, rel=rel), level
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        if level == "O1":
            assert set(dtypes.values()) == {FP32} and opt._pairs == []
        elif level == "O2":
            # norm layers stay fp32, everything else is bf16, with fp32 masters stepped
            assert dtypes == {
                "0.weight": BF16,
                "0.bias": BF16,
                "2.weight": FP32,
                "2.bias": FP32,
                "3.weight": BF16,
                "3.bias": BF16,
            }
            assert len(opt._pairs) == 4
            assert all(m.dtype == FP32 for m in opt.master_params())
            for p, m in opt._pairs:
                assert torch.equal(p, m.to(BF16))
        else:
            assert set(dtypes.values()) == {BF16} and opt._pairs == []


def test_o0_refuses_a_16bit_dtype_it_would_ignore():
    m, o = model_and_opt()
    with pytest.raises(
        ValueError,
        match=r"Recipe\(dtype=torch.float16\): recipe .O0. trains in float32, so the dtype",
    ):
        initialize(m, o, "O0", FP16)
    with pytest.raises(TypeError, match=r"floating dtype .* received torch.int8"):
        initialize(m, o, "O0", torch.int8)
    with pytest.raises(TypeError, match=r"floating dtype .* received torch.int8"):
        initialize(m, o, "O2", torch.int8)


def test_o0_keeps_fp32_and_no_scaling():
    m, o = model_and_opt()
    m, o = initialize(m, o, "O0", FP32)
    assert all(p.dtype == FP32 for p in m.parameters())
    assert o.loss_scale == 1.0  # the table: O0 has no loss scaling
    x, _y = regression_data(8)
    out = m(x)
    assert out.dtype == FP32
    torch.testing.assert_close(out, make_model()(x), rtol=0, atol=0)  # plain fp32 forward


def test_meta_device_model_is_refused_with_the_fix():
    with torch.device("meta"):
        m = make_model()
    with pytest.raises(ValueError, match=r"'meta' device.*to_empty"):
        initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), "O2", BF16)


@pytest.mark.parametrize(
    ("make_loss", "exc", "match"),
    [
        (lambda out: out.float(), ValueError, r"single number, received shape \(8, 4\).*mean"),
        (lambda out: out.sum().long(), TypeError, r"torch.int64 tensor.*floating"),
        (lambda out: out.detach().float().mean(), ValueError, r"does not require grad"),
        (lambda out: 3.0, TypeError, r"received float"),
    ],
    ids=["non-scalar", "integer", "no-grad", "not-a-tensor"],
)
def test_bad_losses_get_a_mixprec_error(make_loss, exc, match):
    m, o = model_and_opt()
    m, o = initialize(m, o, "O2", BF16)
    x, _ = regression_data(8)
    with pytest.raises(exc, match=match):
        o.backward(make_loss(m(x)))
    o.zero_grad()


def test_master_weights_and_keep_norm_overrides_at_o2_o3():
    m, o = model_and_opt()
    m, o = initialize(m, o, mixprec.Recipe("O2", BF16, keep_fp32="none"))
    assert all(p.dtype == BF16 for p in m.parameters()) and len(o._pairs) == 6
    m, o = model_and_opt()
    m, o = initialize(m, o, mixprec.Recipe("O3", BF16, masters=True))
    assert all(p.dtype == BF16 for p in m.parameters()) and len(o._pairs) == 6
    m, o = model_and_opt()
    m, o = initialize(m, o, mixprec.Recipe("O2", BF16, masters=False))
    assert o._pairs == [] and {p.dtype for p in o.master_params()} == {BF16, FP32}


# ------------------------------------------------------------------ 13. error paths


def _o1_error(match: str, *recipe, exc=ValueError, **kw):
    """``initialize(model, opt, *recipe, **kw)`` raises, and leaves the model and optimizer as
    given; a callable in ``recipe`` builds the recipe inside the check (its own errors)."""
    m, o = model_and_opt()
    with pytest.raises(exc, match=match):
        initialize(m, o, *(r() if callable(r) else r for r in recipe), **kw)
    # nothing was modified: the same model and optimizer initialize fine afterwards
    assert all(p.dtype == FP32 for p in m.parameters())
    assert not m.__dict__.get("_mixprec_initialized")
    initialize(m, o, "O2", BF16)


def test_unknown_level():
    _o1_error(r"Cannot read 'O4' as a recipe or a policy: expected 'O0', 'O1'", "O4", BF16)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", [FP32, "fp32", torch.float64])
def test_fp32_dtype_needs_o0(level, dtype):
    _o1_error(rf"Recipe\(dtype=torch.float\d\d\): recipe '{level}' needs a 16-bit", level, dtype)


def test_keep_fp32_none_at_o1():
    _o1_error(
        r"Recipe\(keep_fp32='none'\): modules stay float32 anyway",
        lambda: mixprec.Recipe("O1", BF16, keep_fp32="none"),
    )


def test_masters_at_o1():
    _o1_error(
        r"Recipe\(masters=True\): master weights back 16-bit weights",
        lambda: mixprec.Recipe("O1", BF16, masters=True),
    )


def test_unknown_option():
    _o1_error(r"unexpected keyword argument 'loss_scael'", exc=TypeError, loss_scael="dynamic")
    with pytest.raises(TypeError, match=r"Recipe has no field\(s\) \['loss_scael'\]"):
        mixprec.Recipe("O2", FP16).replace(loss_scael="dynamic")


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_bad_num_losses(bad):
    _o1_error(
        rf"Recipe\(num_losses={bad!r}\): expected an int >= 1",
        lambda: mixprec.Recipe("O2", BF16, num_losses=bad),
    )


def test_static_scale_with_dynamic_option():
    _o1_error(
        r"LossScaling\(dynamic=False\) is a static scale; \['growth_interval'\] only apply",
        lambda: mixprec.Recipe(
            "O2", FP16, loss_scale=mixprec.LossScaling(dynamic=False, growth_interval=10)
        ),
    )


def test_scaler_settings_in_bf16_turn_scaling_on():
    """Scaler settings once needed a scaler that bf16 does not switch on (an error); a
    LossScaling given in bf16 is that scaler, switched on by the recipe."""
    m, o = model_and_opt()
    scaled = mixprec.Recipe("O2", BF16, loss_scale=mixprec.LossScaling(init_scale=8.0))
    m, o = initialize(m, o, scaled)
    assert o.loss_scale == 8.0 and o.slots[0].scaler.dynamic


def test_bad_loss_scale_spec():
    _o1_error(
        r"Recipe\(loss_scale='dyn'\): expected 'auto', 'dynamic', a finite number",
        lambda: mixprec.Recipe("O2", FP16, loss_scale="dyn"),
    )


def test_policy_and_dtype_together():
    _o1_error(r"The policy 'mixed_bfloat16' carries its dtype", "mixed_bfloat16", BF16)
    _o1_error(r"The recipe says dtype=torch.bfloat16 and dtype=torch.float16", "bf16-mixed", FP16)


def test_initialize_twice_on_same_model():
    m, o = model_and_opt()
    m, o = initialize(m, o, "O2", BF16)
    with pytest.raises(RuntimeError, match="initialize was already called on this Sequential"):
        initialize(m, recipe="O2", dtype=BF16)
    with pytest.raises(RuntimeError, match="initialize was already called"):
        initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), "O1", BF16)
    m2 = make_model(1)
    with pytest.raises(RuntimeError, match="already returned by initialize"):
        initialize(m2, o, "O2", BF16)


def test_optimizer_with_foreign_params():
    m1, m2 = make_model(0), make_model(1)
    opt = torch.optim.SGD([*m1.parameters(), m2[3].weight], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"Optimizer 0 holds 1 parameter\(s\) that none of the "
        r"given models own \(shapes \[\(4, 16\)\]",
    ):
        initialize(m1, opt, "O2", BF16)
    assert all(p.dtype == FP32 for p in m1.parameters())
    initialize([m1, m2], opt, "O2", BF16)  # passing every model is fine


def test_non_module_and_non_optimizer_inputs():
    m, o = model_and_opt()
    with pytest.raises(
        TypeError,
        match=r"expects an nn.Module \(or a list of them\), received "
        r"OrderedDict",
    ):
        initialize(m.state_dict(), o, "O1")
    with pytest.raises(TypeError, match=r"expects an nn.Module .* received function"):
        initialize([m, lambda x: x], o, "O1")
    with pytest.raises(TypeError, match=r"takes torch.optim.Optimizer .* received list, which"):
        initialize(m, [list(m.parameters())], "O1")
    with pytest.raises(TypeError, match=r"takes torch.optim.Optimizer .* received dict, which"):
        initialize(m, {"lr": 0.1}, "O1")
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, received int"):
        MixedPrecisionOptimizer(3, [])


def _torch_amp_checkpoint():
    """A run trained with plain torch (as a torch.amp user would have): model and optimizer
    state dicts after three AdamW steps."""
    m = make_model()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y = regression_data(8)
    for _ in range(3):
        mse(m, x, y).backward()
        o.step()
        o.zero_grad()
    return m.state_dict(), o.state_dict()


def _resume(level: str, order: str, **kw):
    weights, opt_state = _torch_amp_checkpoint()
    m = make_model(seed=5)  # other weights: everything must come from the checkpoint
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if order == "load_then_init":  # Apex's documented order
        m.load_state_dict(weights)
        o.load_state_dict(opt_state)
    recipe = mixprec.Recipe(level, BF16 if level != "O0" else None, **kw)
    m, o = initialize(m, o, recipe)
    if order == "init_then_load":
        m.load_state_dict(weights)
        o.load_state_dict(opt_state)  # a plain torch optimizer state dict
    return m, o


@pytest.mark.parametrize(
    ("level", "kw"),
    [("O0", {}), ("O1", {}), ("O2", {}), ("O3", {}), ("O3", dict(update=None))],
    ids=["O0", "O1", "O2", "O3", "O3-update=None"],
)
def test_a_torch_optimizer_state_resumes_in_either_order(level, kw):
    """Loading a plain torch optimizer state before initialize used to be refused ("already
    has state"), and after it raised KeyError (not a MixedPrecisionOptimizer state dict)."""
    _, want = _torch_amp_checkpoint()
    runs = {order: _resume(level, order, **kw) for order in ("load_then_init", "init_then_load")}
    x, y = regression_data(8)
    for order, (m, o) in runs.items():
        got = o.state_dict()
        assert len(got["state"]) == len(want["state"]), order
        assert (o.updater is not None) == (level == "O3" and not kw), order  # bf16 O3: kahan
        for i, s in want["state"].items():  # the state sits on what the wrapper steps
            assert torch.equal(got["state"][i]["step"], s["step"]), order
            # the optimizer's own step casts its state to the weights' dtype; an update mode
            # keeps the saved fp32 state exactly until its step stores it per state_dtype
            dtype = o.master_params()[i].dtype if o.updater is None else torch.float32
            assert torch.equal(got["state"][i]["exp_avg"], s["exp_avg"].to(dtype)), order
            assert torch.equal(got["state"][i]["exp_avg_sq"], s["exp_avg_sq"].to(dtype)), order
        for _ in range(2):
            o.backward(mse(m, x, y))
            o.step()
            o.zero_grad()
    (ma, oa), (mb, ob) = runs.values()
    assert all(
        torch.equal(a, b) for a, b in zip(ma.state_dict().values(), mb.state_dict().values())
    )
    assert all(torch.equal(a, b) for a, b in zip(oa.master_params(), ob.master_params()))


def test_loss_id_out_of_range():
    m, o = model_and_opt()
    m, o = initialize(m, o, mixprec.Recipe("O2", FP16, num_losses=2))
    x, y = regression_data(8)
    for bad in (2, -1):
        with (
            pytest.raises(
                ValueError,
                match=rf"loss_id={bad} is out of range: this optimizer "
                r"was initialized with num_losses=2",
            ),
            scale_loss(mse(m, x, y), o, loss_id=bad) as s,
        ):
            s.backward()
    with pytest.raises(ValueError, match="loss_id=3 is out of range"):
        o.backward(mse(m, x, y), loss_id=3)
    # the failed calls recorded nothing: a normal step still runs
    o.backward(mse(m, x, y), loss_id=1)
    o.step()
    assert not o.step_skipped and o.slots[1].scaler.steps == 1 and o.slots[0].scaler.steps == 0


def test_scale_loss_rejects_plain_optimizer_and_non_tensor_loss():
    m, o = model_and_opt()
    x, y = regression_data(8)
    with (
        pytest.raises(
            TypeError,
            match=r"scale_loss expects the optimizer\(s\) returned by "
            r"mixprec.initialize, received \['SGD'\]",
        ),
        scale_loss(mse(m, x, y), o),
    ):
        pass
    m, w = initialize(m, o, "O2", BF16)
    with pytest.raises(TypeError, match=r"received \['MixedPrecisionOptimizer', 'SGD'\]"):
        with scale_loss(mse(m, x, y), [w, o]):
            pass
    with pytest.raises(TypeError, match="returned by mixprec.initialize, received \\[\\]"):
        with scale_loss(mse(m, x, y), []):
            pass
    with pytest.raises(TypeError, match="scale_loss expects a loss tensor, received float"):
        with scale_loss(1.0, w):
            pass


def test_step_with_closure_raises():
    m, o = model_and_opt()
    m, o = initialize(m, o, "O1", BF16)
    with pytest.raises(NotImplementedError, match="does not take a closure"):
        o.step(lambda: 0.0)


# ------------------------------------------------------------- 14. policies and return shapes


def test_policy_bf16_mixed_is_o1_bf16():
    x, _ = regression_data(8)
    m, o = model_and_opt()
    m, o = initialize(m, o, "bf16-mixed")
    ref, ref_o = model_and_opt()
    ref, ref_o = initialize(ref, ref_o, "O1", BF16)
    assert all(p.dtype == FP32 for p in m.parameters())
    assert o._pairs == [] and o.loss_scale == 1.0
    out, ref_out = m(x), ref(x)
    assert out.dtype == FP32
    assert torch.equal(out, ref_out)
    assert not torch.equal(out, make_model()(x))  # it did compute in bf16


def test_policy_bf16_true_is_o3():
    x, _ = regression_data(8)
    m, o = model_and_opt()
    m, o = initialize(m, o, mixprec.Recipe.from_policy("bf16-true"))
    ref, ref_o = model_and_opt()
    ref, ref_o = initialize(ref, ref_o, mixprec.Recipe("O3", BF16, outputs=BF16))
    assert all(p.dtype == BF16 for p in m.parameters())
    assert o._pairs == [] and o.loss_scale == 1.0
    out = m(x)
    assert out.dtype == BF16  # the policy's output dtype
    assert torch.equal(out, ref(x))


def test_policy_16_mixed_is_o1_fp16_with_dynamic_scaling():
    m, o = model_and_opt()
    m, o = initialize(m, o, "16-mixed")
    assert all(p.dtype == FP32 for p in m.parameters())
    assert o.loss_scale == 2.0**16 and o.slots[0].scaler.dynamic
    x, _ = regression_data(8)
    assert m(x).dtype == FP32


def test_default_level_is_o1_with_default_dtype():
    m, o = model_and_opt()
    m, o = initialize(m, o, "O1")
    assert m.__dict__["_mixprec_initialized"] == "O1"
    assert all(p.dtype == FP32 for p in m.parameters())
    x, _ = regression_data(8)
    assert not torch.equal(m(x), make_model()(x))  # engine on, default dtype (bf16 on CPU)
    assert mixprec.default_dtype("cpu") == BF16


def test_return_shapes():
    m, o = model_and_opt()
    out = initialize([m], [o], "O2", BF16)
    assert isinstance(out, tuple) and len(out) == 2
    (ms, os_) = out
    assert isinstance(ms, list) and ms[0] is m
    assert isinstance(os_, list) and isinstance(os_[0], MixedPrecisionOptimizer)
    assert os_[0].optimizer is o

    m1, m2 = make_model(0), make_model(1)
    o = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.1)
    ms, w = initialize((m1, m2), o, "O1", BF16)
    assert ms == [m1, m2] and isinstance(w, MixedPrecisionOptimizer)

    m = make_model()
    assert initialize(m, None, "O2", BF16) is m
    m1, m2 = make_model(0), make_model(1)
    out = initialize([m1, m2], recipe="O3", dtype=BF16)
    assert isinstance(out, list) and out[0] is m1 and out[1] is m2
    assert all(p.dtype == BF16 for p in m2.parameters())

    m, o = model_and_opt()
    ms, os_ = initialize(m, [], "O1", BF16)
    assert ms is m and os_ == []


def test_model_is_modified_in_place_and_params_keep_identity():
    m, o = model_and_opt()
    params = list(m.parameters())
    m2, w = initialize(m, o, "O2", BF16)
    assert m2 is m
    assert all(a is b for a, b in zip(params, m.parameters()))
    assert all(a is b for a, b in zip(w.model_params(), params))


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        ("bf16", BF16),
        ("bfloat16", BF16),
        ("f16", FP16),
        ("fp16", FP16),
        ("half", FP16),
        ("float16", FP16),
    ],
)
def test_dtype_strings(spelling, expected):
    m, o = model_and_opt()
    m, o = initialize(m, o, "O3", spelling)
    assert {p.dtype for p in m.parameters()} == {expected}
    assert o.loss_scale == (2.0**16 if expected == FP16 else 1.0)


def test_a_policy_spelling_is_a_recipe_not_a_dtype():
    """dtype= names a dtype; a policy spelling goes where the recipe goes."""
    _o1_error(r"Cannot read dtype='bf16-mixed' as a floating dtype", "O3", "bf16-mixed")
    m, o = initialize(*model_and_opt(), "bf16-mixed")
    assert {p.dtype for p in m.parameters()} == {FP32} and o.loss_scale == 1.0


def test_o3_fp16_warns_when_adam_eps_vanishes():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match="eps=1e-08, which rounds to 0 in torch.float16"):
        initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            mixprec.Recipe("O3", torch.float16, update=None),
        )  # explicitly 16-bit arithmetic
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings():  # the default for fp16 Adam is an fp32 update: no warning
        warnings.simplefilter("error", RuntimeWarning)
        _, opt = initialize(model, torch.optim.AdamW(model.parameters()), "O3", torch.float16)
        assert opt.updater is not None
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        initialize(model, torch.optim.AdamW(model.parameters(), eps=1e-4), "O3", torch.float16)
        model = nn.Sequential(nn.Linear(4, 4))  # bf16 has fp32's range: 1e-8 is fine
        initialize(model, torch.optim.AdamW(model.parameters()), "O3", torch.bfloat16)


def test_a_per_module_policy_map_is_applied_before_the_level():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    model[2].register_forward_hook(lambda m, i, o: seen.update(out=o.dtype))
    model[0].register_forward_hook(lambda m, i, o: seen.update(first=o.dtype))
    mixprec.set_policy(model[2], "float32")  # a per-module policy, then the level
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float32
    model(torch.randn(3, 8)).sum().backward()
    assert seen == {"first": torch.bfloat16, "out": torch.float32}
    # a {module path: policy} map as the recipe (tune's plan) is applied at O1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    seen.clear()
    model[2].register_forward_hook(lambda m, i, o: seen.update(out=o.dtype))
    model[0].register_forward_hook(lambda m, i, o: seen.update(first=o.dtype))
    model = mixprec.initialize(model, None, {"2": "float32"}, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # O1: fp32 storage
    model(torch.randn(3, 8))
    assert seen == {"first": torch.bfloat16, "out": torch.float32}
    with pytest.raises(ValueError, match="does not have"):
        mixprec.initialize(nn.Linear(2, 2), recipe={"head": "float32"})
    with pytest.raises(ValueError, match="one model"):
        mixprec.initialize([nn.Linear(2, 2), nn.Linear(2, 2)], recipe={"": "float32"})


def test_wrapped_distributed_models_are_refused_with_the_order_to_use():
    class DistributedDataParallel(nn.Module):  # stands in for torch's (needs a process group)
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="then mixprec.distributed.wrap_ddp"):
        mixprec.initialize(DistributedDataParallel(), recipe="O1")
    fsdp = type("FSDPLinear", (nn.Linear, type("FSDPModule", (), {})), {})(2, 2)
    with pytest.raises(TypeError, match="initialize_fsdp"):
        mixprec.initialize(fsdp, recipe="O1")


# -- the masters start from the weights the model held ---------------------------------------------
class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            for _ in range(2)
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("make", [_mlp, _Residual], ids=["mlp", "residual"])
@pytest.mark.parametrize("order", ["load_then_init", "init_then_load"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_masters_hold_the_loaded_fp32_weights_bit_for_bit(make, order, dtype):
    """Load pretrained fp32 weights, then initialize (the usual fine-tuning order): the masters
    used to be built from the 16-bit rounding (bf16: relative error 2-3e-3 per tensor)."""
    torch.manual_seed(0)
    pretrained = {k: v.clone() for k, v in make().state_dict().items()}
    torch.manual_seed(1)
    model = make()
    if order == "load_then_init":
        model.load_state_dict(pretrained)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, "O2", dtype)
    if order == "init_then_load":
        model.load_state_dict(pretrained)
    assert any(p.dtype == dtype for p in model.parameters())  # the model itself is 16-bit
    got = mixprec.fp32_state_dict(model, opt)
    assert got.keys() == pretrained.keys()
    for key, want in pretrained.items():
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], want), key
    # and training starts from them: one step with lr 0 changes nothing
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.backward(model(torch.randn(2, 8 if make is _mlp else 16)).float().sum())
    opt.step()
    assert all(torch.equal(mixprec.fp32_state_dict(model, opt)[k], pretrained[k]) for k in got)


def test_o2_masters_do_not_share_storage_with_the_users_tensors():
    """A model whose parameters *are* the user's tensors (load_state_dict(assign=True)): the
    masters are copies, so stepping them leaves the user's dict alone."""
    torch.manual_seed(0)
    pretrained = {k: v.clone() for k, v in _mlp().state_dict().items()}
    kept = {k: v.clone() for k, v in pretrained.items()}
    model = _mlp()
    model.load_state_dict(pretrained, assign=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    opt.backward(model(torch.randn(4, 8)).float().pow(2).sum())
    opt.step()
    assert all(torch.equal(pretrained[k], kept[k]) for k in kept)
    assert not torch.equal(mixprec.fp32_state_dict(model, opt)["0.weight"], kept["0.weight"])


class _Lars:
    """An optimizer wrapper that is not a torch optimizer (as Apex's LARC): it scales each
    gradient by a trust ratio, then steps the optimizer it wraps."""

    def __init__(self, optimizer, trust: float = 0.02):
        self.optim, self.trust = optimizer, trust

    param_groups = property(lambda self: self.optim.param_groups)
    state = property(lambda self: self.optim.state)

    def step(self):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        ratio = self.trust * p.norm() / (p.grad.norm() + 1e-12)
                        p.grad.mul_(ratio)
        return self.optim.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_an_optimizer_wrapper_trains_at_every_level_and_sees_the_masters(level):
    m = make_model()
    lars = _Lars(torch.optim.SGD(m.parameters(), lr=0.5))
    m, o = initialize(m, lars, level, BF16 if level != "O0" else None)
    x, y = regression_data(16)
    losses = []
    for _ in range(6):
        loss = mse(m, x, y)
        losses.append(loss.item())
        o.backward(loss)
        o.step()
        o.zero_grad()
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses)
    if level == "O2":  # the wrapper steps the fp32 masters
        assert all(p.dtype == FP32 for g in lars.param_groups for p in g["params"])


def test_an_object_that_is_no_optimizer_is_refused_with_what_it_lacks():
    with pytest.raises(TypeError, match=r"initialize takes torch.optim.Optimizer.*no state, step"):
        initialize(make_model(), type("Fake", (), {"param_groups": []})(), "O2", BF16)


@pytest.mark.parametrize("level", ["O2"])
def test_stepping_the_original_optimizer_after_initialize_raises_with_the_fix(level):
    """`mixprec.initialize(model, opt, "O2")` without `model, opt =`: the original optimizer
    now holds the fp32 masters, which get no gradients -- 20 steps moved the weights by exactly
    0, silently."""
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mixprec.initialize(m, opt, level, BF16)
    x, y = regression_data(8)
    mse(m, x, y).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"wrapped by mixprec.initialize.*model, opt = mixprec"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_the_returned_optimizer_still_steps_with_the_guard_in_place():
    m = make_model()
    m, opt = mixprec.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), "O2", BF16)
    x, y = regression_data(8)
    before = [p.detach().clone() for p in m.parameters()]
    opt.backward(mse(m, x, y))
    opt.step()
    assert not opt.step_skipped
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
    import pickle

    pickle.loads(pickle.dumps(opt.optimizer))  # the guard pickles (it guards nothing there)
