"""Tests for mixprec._core.loss_scale: scale trajectories, validation, state_dict, fused unscale."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec._core import loss_scale as ls
from mixprec._core.loss_scale import LossScaler, found_non_finite, unscale_and_check_

INF, NAN = float("inf"), float("nan")
FIELDS = (
    "init_scale",
    "dynamic",
    "enabled",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "steps",
    "skipped_steps",
    "last_step_skipped",
)


def run(scaler: LossScaler, verdicts) -> list[float]:
    out = []
    for v in verdicts:
        scaler.update(bool(v))
        out.append(scaler.scale)
    return out


# --------------------------------------------------------------------------- state machine


def test_defaults():
    s = LossScaler()
    assert (s.scale, s.loss_scale, s.dynamic, s.enabled) == (2.0**16, 2.0**16, True, True)
    assert (s.growth_factor, s.backoff_factor, s.growth_interval, s.hysteresis) == (
        2.0,
        0.5,
        2000,
        1,
    )
    assert (s.min_scale, s.max_scale) == (1.0, 2.0**24)
    assert (s.growth_tracker, s.hysteresis_tracker, s.steps, s.skipped_steps) == (0, 1, 0, 0)
    assert s.last_step_skipped is None
    assert type(s.scale) is float and s.inv_scale == 2.0**-16


def test_growth_closed_form():
    s = LossScaler(8.0, growth_interval=3)
    traj = run(s, [False] * 10)
    assert traj == [8, 8, 16, 16, 16, 32, 32, 32, 64, 64]
    assert s.scale == 8.0 * 2**3 and s.growth_tracker == 1
    assert (s.steps, s.skipped_steps, s.last_step_skipped) == (10, 0, False)


def test_keras_reference_numbers():
    s = LossScaler(400.0)
    run(s, [True] * 4)
    assert s.scale_loss(torch.tensor(1.0)).item() == 25.0
    s = LossScaler(2.0, growth_interval=2)
    run(s, [False] * 8)
    assert s.scale_loss(torch.tensor(1.0)).item() == 32.0


def test_backoff_every_overflow_and_growth_tracker_reset():
    s = LossScaler(1024.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.25)
    assert run(s, [False, False, True]) == [1024, 1024, 256]
    assert s.growth_tracker == 0 and s.skipped_steps == 1 and s.last_step_skipped is True
    assert run(s, [False, False, False, True, True]) == [256, 256, 1024, 256, 64]
    assert (s.steps, s.skipped_steps) == (8, 3)


def test_hysteresis():
    s = LossScaler(1024.0, hysteresis=3)
    assert run(s, [True, True]) == [1024, 1024]
    assert s.hysteresis_tracker == 1
    assert run(s, [True]) == [512]
    assert s.hysteresis_tracker == 3
    # A clean step in between resets the count.
    assert run(s, [True, True, False, True, True]) == [512] * 5
    assert s.hysteresis_tracker == 1
    assert run(s, [True, True, True, True]) == [256, 256, 256, 128]
    assert s.skipped_steps == 11


def test_bounds_never_zero_or_inf():
    s = LossScaler(4.0, min_scale=0.25, backoff_factor=0.125)
    run(s, [True] * 10_000)
    assert s.scale == 0.25
    s = LossScaler(1.0, min_scale=5e-324)  # smallest positive double: still never 0
    run(s, [True] * 10_000)
    assert s.scale == 5e-324 and s.scale > 0
    s = LossScaler(4.0, growth_interval=1, max_scale=100.0)
    assert run(s, [False] * 6) == [8, 16, 32, 64, 100, 100]
    s = LossScaler(1.0, growth_interval=1, growth_factor=1e10, max_scale=1e308)
    run(s, [False] * 10_000)
    assert s.scale == 1e308 and math.isfinite(s.scale)


def test_static_never_changes_but_counts_skips():
    s = LossScaler(128.0, dynamic=False, growth_interval=1)
    run(s, [False] * 5 + [True] * 3 + [False])
    assert s.scale == 128.0 and not s.dynamic and s.enabled
    assert (s.steps, s.skipped_steps, s.last_step_skipped) == (9, 3, False)
    assert (s.growth_tracker, s.hysteresis_tracker) == (0, 1)
    # A static scale is not bound by min/max (those bind dynamic scaling only).
    assert LossScaler(0.5, dynamic=False).scale == 0.5
    assert LossScaler(2.0**30, dynamic=False).scale == 2.0**30


def test_disabled():
    s = LossScaler(1024.0, enabled=False)
    assert s.scale == 1.0 and not s.dynamic and not s.enabled
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss
    run(s, [True, False, True])
    assert s.scale == 1.0 and (s.steps, s.skipped_steps, s.last_step_skipped) == (3, 2, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_loss(dtype):
    s = LossScaler(1024.0)
    w = torch.tensor(3.0, dtype=dtype, requires_grad=True)
    scaled = s.scale_loss(w * 2)
    assert scaled.dtype == dtype and scaled.item() == 6 * 1024
    scaled.backward()
    assert w.grad.item() == 2 * 1024
    one = LossScaler(1.0, dynamic=False)
    assert one.scale_loss(w) is w
    with pytest.raises(TypeError, match="torch.Tensor; received float"):
        s.scale_loss(1.0)


@pytest.mark.parametrize("bad", [0, 1, None, "yes", torch.zeros(1)])
def test_update_requires_bool(bad):
    with pytest.raises(TypeError, match=r"expects a bool.*bool\(flag\)"):
        LossScaler().update(bad)


def test_repr():
    s = LossScaler(64.0, hysteresis=2)
    s.update(True)
    r = repr(s)
    assert "dynamic" in r and "scale=64.0" in r and "hysteresis=1/2" in r and "skipped_steps=1" in r
    assert repr(LossScaler(8.0, dynamic=False)).startswith("LossScaler(static, scale=8.0")
    assert repr(LossScaler(enabled=False)).startswith("LossScaler(disabled, scale=1.0")


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"init_scale": 0.0}, ValueError, r"init_scale must be finite and > 0; received 0.0"),
        ({"init_scale": -2.0}, ValueError, r"init_scale must be finite and > 0"),
        ({"init_scale": INF}, ValueError, r"init_scale must be finite"),
        ({"init_scale": NAN}, ValueError, r"init_scale must be finite"),
        ({"init_scale": "65536"}, TypeError, r"init_scale must be a real number.*str"),
        ({"init_scale": True}, TypeError, r"init_scale must be a real number.*bool"),
        ({"growth_factor": 1.0}, ValueError, r"growth_factor must be finite and > 1; received 1.0"),
        ({"growth_factor": INF}, ValueError, r"growth_factor must be finite and > 1"),
        (
            {"backoff_factor": 1.0},
            ValueError,
            r"backoff_factor must be in the open interval \(0, 1\)",
        ),
        ({"backoff_factor": 0.0}, ValueError, r"backoff_factor must be in the open interval"),
        ({"backoff_factor": 2.0}, ValueError, r"backoff_factor .* received 2.0"),
        ({"growth_interval": 0}, ValueError, r"growth_interval must be an int >= 1; received 0"),
        ({"growth_interval": 2.0}, TypeError, r"growth_interval must be an int >= 1; .*float"),
        ({"growth_interval": True}, TypeError, r"growth_interval must be an int"),
        ({"hysteresis": 0}, ValueError, r"hysteresis must be an int >= 1; received 0"),
        ({"hysteresis": 1.5}, TypeError, r"hysteresis must be an int"),
        ({"min_scale": 0.0}, ValueError, r"min_scale must be finite and > 0"),
        ({"min_scale": -1.0}, ValueError, r"min_scale must be finite and > 0"),
        ({"max_scale": INF}, ValueError, r"max_scale must be finite and >= min_scale"),
        ({"max_scale": 0.5}, ValueError, r"max_scale must be finite and >= min_scale \(1.0\)"),
        ({"init_scale": 0.5}, ValueError, r"init_scale=0.5 is outside .* \[1.0, 16777216.0\]"),
        ({"init_scale": 2.0**25}, ValueError, r"outside \[min_scale, max_scale\]"),
        (
            {"init_scale": 8.0, "min_scale": 16.0, "max_scale": 32.0},
            ValueError,
            r"init_scale=8.0 is outside \[min_scale, max_scale\] = \[16.0, 32.0\]",
        ),
        (
            {"dynamic": "dynamic"},
            TypeError,
            r"dynamic must be a bool; received 'dynamic'.*from_spec",
        ),
        ({"enabled": 1}, TypeError, r"enabled must be a bool"),
    ],
)
def test_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LossScaler(**kwargs)


# --------------------------------------------------------------------------- from_spec


def test_from_spec_forms():
    d = LossScaler.from_spec("dynamic", growth_interval=5, init_scale=256.0)
    assert d.dynamic and d.growth_interval == 5 and d.scale == 256.0
    s = LossScaler.from_spec(128)
    assert not s.dynamic and s.enabled and s.scale == 128.0 and type(s.scale) is float
    assert LossScaler.from_spec(0.5).scale == 0.5
    assert LossScaler.from_spec(8.0, enabled=True).scale == 8.0
    off = LossScaler.from_spec(None)
    assert not off.enabled and off.scale == 1.0
    assert LossScaler.from_spec(d) is d


@pytest.mark.parametrize(
    ("spec", "kwargs", "match"),
    [
        ("Dynamic", {}, r"Unknown loss-scale spec 'Dynamic'. Allowed: 'dynamic', a finite number"),
        ("static", {}, r"Unknown loss-scale spec"),
        (True, {}, r"Unknown loss-scale spec True"),
        (0, {}, r"Unknown loss-scale spec 0"),
        (-4.0, {}, r"Unknown loss-scale spec"),
        (INF, {}, r"Unknown loss-scale spec inf"),
        (NAN, {}, r"Unknown loss-scale spec nan"),
        ([128.0], {}, r"Unknown loss-scale spec"),
        (
            128.0,
            {"growth_interval": 10},
            r"does not use \['growth_interval'\].*only apply to dynamic",
        ),
        (
            128.0,
            {"hysteresis": 2, "backoff_factor": 0.5},
            r"\['backoff_factor', 'hysteresis'\].*dynamic",
        ),
        (128.0, {"min_scale": 2.0}, r"\['min_scale'\]"),
        (128.0, {"init_scale": 2.0}, r"\['init_scale'\]"),
        (None, {"growth_interval": 10}, r"None disables loss scaling.*\['growth_interval'\]"),
        ("dynamic", {"dynamic": False}, r"takes dynamic= from the spec"),
        (LossScaler(), {"hysteresis": 2}, r"existing LossScaler and options \['hysteresis'\]"),
    ],
)
def test_from_spec_errors(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler.from_spec(spec, **kwargs)


def test_from_spec_forwards_validation():
    with pytest.raises(ValueError, match="growth_interval must be an int >= 1"):
        LossScaler.from_spec("dynamic", growth_interval=0)


# --------------------------------------------------------------------------- state_dict


def _non_default() -> LossScaler:
    s = LossScaler(
        96.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=4,
        hysteresis=3,
        min_scale=0.75,
        max_scale=5000.0,
    )
    run(s, [False, False, True, True, True, False, False, True, False])
    return s


def test_state_dict_round_trip_non_default():
    src = _non_default()
    sd = src.state_dict()
    assert set(sd) == set(FIELDS)
    defaults = LossScaler().state_dict()
    assert all(sd[k] != defaults[k] for k in FIELDS if k not in ("dynamic", "enabled")), sd
    # Plain Python values: survives JSON, pickle and torch.load(weights_only=True).
    assert json.loads(json.dumps(sd)) == sd
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == sd
    dst = LossScaler()
    dst.load_state_dict(pickle.loads(pickle.dumps(sd)))
    for k in FIELDS:
        assert getattr(dst, k) == getattr(src, k), k
    tail = [False] * 9 + [True] * 4 + [False] * 5
    assert run(dst, tail) == run(src, tail)
    assert dst.state_dict() == src.state_dict()
    assert pickle.loads(pickle.dumps(src)).state_dict() == src.state_dict()


@pytest.mark.parametrize(
    "make", [lambda: LossScaler(12.0, dynamic=False), lambda: LossScaler(12.0, enabled=False)]
)
def test_state_dict_round_trip_static_and_disabled(make):
    src = make()
    run(src, [True, False, True])
    dst = LossScaler()
    dst.load_state_dict(src.state_dict())
    assert dst.state_dict() == src.state_dict()
    assert (dst.dynamic, dst.enabled, dst.scale) == (src.dynamic, src.enabled, src.scale)


def _bad(**changes):
    sd = _non_default().state_dict()
    sd.update(changes)
    return sd


@pytest.mark.parametrize(
    ("sd", "exc", "match"),
    [
        (
            {k: v for k, v in _non_default().state_dict().items() if k not in ("scale", "steps")},
            ValueError,
            r"missing keys \['scale', 'steps'\], unknown keys \[\]",
        ),
        (
            _bad(_growth_tracker=0, extra=1),
            ValueError,
            r"unknown keys \['_growth_tracker', 'extra'\]",
        ),
        ({}, ValueError, r"missing keys \['backoff_factor'"),
        (_bad(hysteresis=0), ValueError, r"hysteresis must be an int >= 1"),
        (_bad(scale=0.0), ValueError, r"scale must be finite and > 0"),
        (_bad(scale=INF), ValueError, r"scale must be finite"),
        (_bad(scale=0.5), ValueError, r"scale=0.5 must lie in \[0.75, 5000.0\]"),
        (_bad(dynamic=False, scale=48.0), ValueError, r"scale=48.0 must lie in \[96.0, 96.0\]"),
        (_bad(growth_tracker=-1), ValueError, r"growth_tracker must be an int >= 0"),
        (_bad(growth_tracker=1.0), TypeError, r"growth_tracker must be an int"),
        (_bad(hysteresis_tracker=4), ValueError, r"hysteresis_tracker=4 exceeds hysteresis=3"),
        (_bad(hysteresis_tracker=0), ValueError, r"hysteresis_tracker must be an int >= 1"),
        (_bad(skipped_steps=100), ValueError, r"skipped_steps=100 exceeds steps=9"),
        (
            _bad(last_step_skipped=None),
            ValueError,
            r"last_step_skipped must be None iff steps == 0",
        ),
        (_bad(last_step_skipped=1), ValueError, r"last_step_skipped .* received 1"),
    ],
)
def test_load_state_dict_errors_are_atomic(sd, exc, match):
    dst = LossScaler(32.0, hysteresis=2)
    dst.update(True)
    before = dst.state_dict()
    with pytest.raises(exc, match=match):
        dst.load_state_dict(sd)
    assert dst.state_dict() == before


# --------------------------------------------------------------------------- property test


def reference_trajectory(cfg: dict, verdicts: list[bool]) -> list[tuple]:
    """Independent model: count consecutive overflows up instead of a tracker counting down."""
    scale, clean_run, bad_run, skipped, out = cfg["init_scale"], 0, 0, 0, []
    for i, bad in enumerate(verdicts):
        if bad:
            skipped += 1
            clean_run, bad_run = 0, bad_run + 1
            if bad_run == cfg["hysteresis"]:
                scale, bad_run = max(scale * cfg["backoff_factor"], cfg["min_scale"]), 0
        else:
            clean_run, bad_run = clean_run + 1, 0
            if clean_run == cfg["growth_interval"]:
                scale, clean_run = min(scale * cfg["growth_factor"], cfg["max_scale"]), 0
        out.append((scale, clean_run, cfg["hysteresis"] - bad_run, i + 1, skipped, bad))
    return out


@settings(max_examples=150, deadline=None)
@given(
    verdicts=st.lists(st.booleans(), max_size=120),
    growth_interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    growth_factor=st.sampled_from([1.5, 2.0, 4.0]),
    backoff_factor=st.sampled_from([0.125, 0.5, 0.75]),
    min_exp=st.integers(-4, 4),
    span=st.integers(0, 12),
    offset=st.integers(0, 12),
    cut=st.integers(0, 120),
)
def test_trajectory_matches_reference(
    verdicts, growth_interval, hysteresis, growth_factor, backoff_factor, min_exp, span, offset, cut
):
    min_scale = 2.0**min_exp
    max_scale = min_scale * 2.0**span
    init = min_scale * 2.0 ** min(offset, span)
    cfg = dict(
        init_scale=init,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    s = LossScaler(**cfg)
    got = []
    for i, v in enumerate(verdicts):
        if i == cut:  # a mid-training checkpoint restore must not change the trajectory
            fresh = LossScaler()
            fresh.load_state_dict(s.state_dict())
            s = fresh
        s.update(v)
        got.append(
            (
                s.scale,
                s.growth_tracker,
                s.hysteresis_tracker,
                s.steps,
                s.skipped_steps,
                s.last_step_skipped,
            )
        )
        assert 0 < s.scale < INF and min_scale <= s.scale <= max_scale
    assert got == reference_trajectory(cfg, verdicts)


# --------------------------------------------------------------------------- unscale / check

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALE = 1024.0


def _grads(dtype):
    # Values times 1/1024 are exact in every dtype (and fp16 stays below 65504).
    base = [
        torch.tensor([1.5, -3.0, 0.0, 7.0]),
        torch.arange(-6.0, 6.0).reshape(3, 4),
        torch.tensor(5.0),
    ]
    return [(b * SCALE).to(dtype) for b in base], [b.to(dtype) for b in base]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("inv", [1 / SCALE, torch.tensor([1 / SCALE])])
def test_unscale_and_check_non_finite(dtype, bad, which, inv):
    grads, expected = _grads(dtype)
    grads[which].view(-1)[-1] = bad
    found = torch.zeros(1)
    unscale_and_check_(grads, inv, found)
    assert found.item() == 1.0
    for i, (g, e) in enumerate(zip(grads, expected)):
        assert g.dtype == dtype
        if i != which:
            assert torch.equal(g, e)
        else:
            assert torch.equal(g.view(-1)[:-1], e.view(-1)[:-1])
            last = g.view(-1)[-1].item()
            assert math.isnan(last) if math.isnan(bad) else last == bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_and_check_finite(dtype):
    grads, expected = _grads(dtype)
    found = torch.zeros(1)
    unscale_and_check_(grads, 1 / SCALE, found)
    assert found.item() == 0.0
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_unscale_mixed_dtypes_tensor_inv_forms_and_flag_not_reset():
    grads = [
        torch.full((3,), 8.0),
        torch.full((2,), 8.0, dtype=torch.bfloat16),
        torch.full((2,), 8.0, dtype=torch.float16),
        torch.full((2,), 8.0, dtype=torch.float64),
    ]
    found = torch.ones(())  # a 0-dim flag is fine too; a previous 1 is kept
    for inv in (torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float64), 0.5):
        unscale_and_check_(grads, inv, found)
    assert found.item() == 1.0
    assert all(torch.equal(g, torch.ones_like(g)) for g in grads)
    unscale_and_check_([], 0.5, found)  # empty list: no-op


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (
            ([torch.ones(2)], 0.5, torch.zeros(1, dtype=torch.float64)),
            TypeError,
            r"found_inf must be a 1-element float32 tensor",
        ),
        (([torch.ones(2)], 0.5, torch.zeros(2)), TypeError, r"found_inf must be a 1-element"),
        (([torch.ones(2)], 0.5, 0.0), TypeError, r"found_inf must be"),
        (
            ([torch.ones(2), torch.ones(2, dtype=torch.int32)], 0.5, torch.zeros(1)),
            TypeError,
            r"tensors\[1\] must be a floating tensor \(dense or sparse, real or complex\); "
            r"received torch.int32",
        ),
        (([[1.0]], 0.5, torch.zeros(1)), TypeError, r"received list"),
        (
            ([torch.ones(2, device="meta")], 0.5, torch.zeros(1)),
            ValueError,
            r"tensors\[0\] is on meta but found_inf is on cpu",
        ),
    ],
)
def test_unscale_and_check_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        unscale_and_check_(*args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_path_matches_fused(monkeypatch, dtype):
    calls = []

    def unsupported(*args):
        calls.append(1)
        raise NotImplementedError("not implemented for this backend")

    monkeypatch.setattr(ls, "_NO_FUSED_KERNEL", set())
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unsupported)
    for bad in (None, INF, NAN):
        grads, expected = _grads(dtype)
        if bad is not None:
            grads[1][0, 0] = bad
            expected[1][0, 0] = bad
        found = torch.zeros(1)
        unscale_and_check_(grads, 1 / SCALE, found)
        assert found.item() == (bad is not None)
        for g, e in zip(grads, expected):
            assert torch.equal(g, e) or (bad is not None and torch.allclose(g, e, equal_nan=True))
    assert len(calls) == 1 and {("cpu", dtype)} == ls._NO_FUSED_KERNEL  # tried once, cached
    g = [torch.tensor([-0.0, 3.0, INF], dtype=dtype)]
    found = torch.zeros(1)
    found_non_finite(g, found)
    assert found.item() == 1.0 and torch.equal(torch.signbit(g[0]), torch.tensor([1, 0, 0]) > 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_found_non_finite_leaves_values_untouched(dtype):
    g = [torch.tensor([-0.0, 1e-3, 3.0, -7.5], dtype=dtype), torch.tensor([2.0], dtype=dtype)]
    snapshot = [t.clone() for t in g]
    found = torch.zeros(1)
    found_non_finite(g, found)
    assert found.item() == 0.0
    assert all(
        torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()) for a, b in zip(g, snapshot)
    )
    g[1][0] = NAN
    found_non_finite(g, found)
    assert found.item() == 1.0 and torch.equal(g[0], snapshot[0])


@pytest.mark.parametrize("fused", [True, False])
def test_no_host_sync(monkeypatch, fused):
    """No Tensor->Python conversion happens on the hot path (proxy for 'no device sync')."""
    grads, _ = _grads(torch.float32)
    grads[0][0] = INF
    found = torch.zeros(1)
    scaler = LossScaler(SCALE)
    loss = torch.tensor(2.0)
    if not fused:
        monkeypatch.setattr(ls, "_NO_FUSED_KERNEL", {("cpu", torch.float32)})

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    scaled = scaler.scale_loss(loss)
    unscale_and_check_(grads, scaler.inv_scale, found)
    unscale_and_check_(grads, torch.tensor([scaler.inv_scale]), found)
    found_non_finite(grads, found)
    scaler.update(True)
    monkeypatch.undo()
    assert found.item() == 1.0 and scaled.item() == 2 * SCALE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for sync debug mode")
def test_no_cuda_sync():  # pragma: no cover - CPU-only CI
    grads = [torch.ones(4, device="cuda"), torch.ones(4, device="cuda", dtype=torch.float16)]
    found = torch.zeros(1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        unscale_and_check_(grads, 0.5, found)
        found_non_finite(grads, found)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_disabled_is_the_unchecked_disabled_scaler():
    assert LossScaler.disabled().state_dict() == LossScaler(enabled=False).state_dict()
    assert LossScaler.from_spec(None).state_dict() == LossScaler(enabled=False).state_dict()
