"""Tests for mixprec._core.engine and mixprec._core.attention: regions, gradients, the cast cache,
module policy boundaries, attention, a model-level run and the public import surface."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec._core import _frames, attention, engine
from mixprec._core.engine import set_policy
from mixprec._core.policy import set_global_policy
from mixprec.bench.models import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

REPO = Path(__file__).resolve().parents[2]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LOW = [BF16, F16]


@pytest.fixture(autouse=True)
def _clean_engine_state():
    """Every test starts and must end outside any region with torch.autocast off."""
    set_global_policy(None)
    cpu_dtype = torch.get_autocast_dtype("cpu")
    assert not _frames._state.frames
    yield
    set_global_policy(None)
    assert not _frames._state.frames, "a region leaked out of the test"
    assert not engine.is_active()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == cpu_dtype
    assert torch.is_autocast_cache_enabled()


def rn(*shape, dtype=F32, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def lin_ref(x, lin, dtype):
    return F.linear(x.to(dtype), lin.weight.detach().to(dtype), lin.bias.detach().to(dtype))


class CastCounter(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy / copy_) whose source is one of ``watch``."""

    def __init__(self, *watch: torch.Tensor):
        super().__init__()
        self.watch = watch
        self.count = 0
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.total += 1
            self.count += any(args[0] is w for w in self.watch)
        elif func is torch.ops.aten.copy_.default:
            self.total += 1
            self.count += any(args[1] is w for w in self.watch)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- regions


def test_region_state_and_restore():
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
    with mixprec.autocast(BF16) as region:
        assert isinstance(region, mixprec.autocast)
        assert engine.is_active()
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
        assert torch.is_autocast_cache_enabled()  # torch's weight-cast cache serves it
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")


def test_region_restores_on_exception():
    lin = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="boom"), mixprec.autocast(BF16):
        lin(rn(2, 4))
        raise RuntimeError("boom")
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
    assert lin(rn(2, 4)).dtype == F32


def test_nested_regions_bf16_fp16_bf16():
    lin, x = nn.Linear(4, 3), rn(2, 4)
    with mixprec.autocast(BF16):
        a = lin(x)
        with mixprec.autocast(F16):
            assert engine.is_active() and torch.get_autocast_dtype("cpu") == F16
            b = lin(x)
            s = torch.softmax(b, -1)
        assert torch.get_autocast_dtype("cpu") == BF16
        c = lin(x)
    assert a.dtype == BF16 and b.dtype == F16 and c.dtype == BF16 and s.dtype == F32
    assert torch.equal(a, lin_ref(x, lin, BF16)) and torch.equal(c, a)
    assert torch.equal(b, lin_ref(x, lin, F16))


def test_enabled_false_is_a_noop():
    lin, x = nn.Linear(4, 3), rn(2, 4)
    with mixprec.autocast(BF16, enabled=False):
        assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
        y = lin(x)
        assert torch.softmax(y, -1).dtype == F32
    assert y.dtype == F32 and torch.equal(y, lin(x))
    with mixprec.autocast(BF16):
        with mixprec.autocast(F16, enabled=False):  # no-op: the outer bf16 region still rules
            assert lin(x).dtype == BF16


def test_float32_region_inside_bf16_region_disables():
    lin, x = nn.Linear(4, 3), rn(2, 4)
    with mixprec.autocast(BF16):
        with mixprec.autocast("float32"):
            assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
            y = lin(x)
        assert engine.is_active() and lin(x).dtype == BF16
    assert y.dtype == F32 and torch.equal(y, lin(x))


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [("mixed_float16", F16), ("bf16-mixed", BF16), ("p=f32,c=f16,o=f32", F16), (BF16, BF16)],
)
def test_region_accepts_policy_spellings(spec, dtype):
    lin, x = nn.Linear(4, 3), rn(2, 4)
    with mixprec.autocast(spec):
        y = lin(x)
    assert y.dtype == dtype and torch.equal(y, lin_ref(x, lin, dtype))


def test_region_argument_errors():
    with pytest.raises(ValueError, match="kernels"):
        mixprec.autocast(mixprec.Recipe("O1", BF16, kernels="flash"))
    with pytest.raises(ValueError):
        mixprec.autocast(torch.int32)
    with pytest.raises(ValueError):
        mixprec.autocast("bogus")


def test_same_region_object_reentrant():
    region, lin, x = mixprec.autocast(BF16), nn.Linear(4, 3), rn(2, 4)
    with region:
        with region:
            assert lin(x).dtype == BF16
        assert engine.is_active()
    assert not engine.is_active()


def test_region_is_thread_local():
    lin, x = nn.Linear(4, 3), rn(2, 4)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait(10)
        seen["active"] = engine.is_active()
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["dtype"] = lin(x).dtype
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with mixprec.autocast(BF16):
        inside.set()
        done.wait(10)
        assert lin(x).dtype == BF16
    t.join(10)
    assert seen == {"active": False, "autocast": False, "dtype": F32}


# --------------------------------------------------------------------------- torch.autocast gap


def test_fp32_ops_protected_where_torch_autocast_is_not():
    x = rn(4, 6, dtype=BF16)
    ops = {
        "softmax": lambda t: torch.softmax(t, -1),
        "layer_norm": lambda t: F.layer_norm(t, (6,)),
        "sum": lambda t: t.sum(),
    }
    with torch.autocast("cpu", BF16):
        theirs = {k: f(x) for k, f in ops.items()}
    with mixprec.autocast(BF16):
        ours = {k: f(x) for k, f in ops.items()}
    for k, f in ops.items():
        assert theirs[k].dtype == BF16, k  # torch.autocast leaves these in bf16 on CPU
        assert ours[k].dtype == F32, k  # mixprec runs them in float32
        assert torch.equal(ours[k], f(x.float())), k


# --------------------------------------------------------------------------- input gradients


def _grad_cases():
    def lower(x, y, w):
        return [F.linear(x, w), x @ w.t(), F.linear(y, w), torch.bmm(x[None], y.t()[None])[0]]

    def fp32(x, y, w):
        return [
            torch.softmax(x, -1),
            torch.softmax(y, -1),
            F.layer_norm(y, (4,)),
            y.sum(),
            F.cross_entropy(y, torch.tensor([0, 3, 1])),
            x.exp(),
        ]

    def promote(x, y, w):
        return [x + y, torch.cat([x, y]), torch.where(x > 0, x, y), y * x]

    def unlisted(x, y, w):
        return [F.relu(x), F.gelu(y), y.view(-1)]

    return [("lower", lower), ("fp32", fp32), ("promote", promote), ("unlisted", unlisted)]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("name", "fn"), _grad_cases(), ids=[c[0] for c in _grad_cases()])
def test_input_grad_dtypes_match_inputs(dtype, name, fn):
    x = rn(3, 4).requires_grad_()
    y = rn(3, 4, dtype=dtype, seed=7).requires_grad_()
    w = rn(5, 4).requires_grad_()
    with mixprec.autocast(dtype):
        outs = fn(x, y, w)
    loss = sum(o.float().sum() for o in outs)
    loss.backward()  # outside the region
    for t in (x, y, w):
        if t.grad is not None:
            assert t.grad.dtype == t.dtype, (name, t.dtype, t.grad.dtype)
            assert torch.isfinite(t.grad).all()
    assert x.grad is not None or y.grad is not None


def test_input_grads_equal_manual_cast_reference():
    x = rn(3, 4).requires_grad_()
    w = rn(5, 4).requires_grad_()
    with mixprec.autocast(BF16):
        loss = F.cross_entropy(F.linear(x, w), torch.tensor([0, 1, 4]))
    loss.backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(x2.bfloat16(), w2.bfloat16()).float(), torch.tensor([0, 1, 4]))
    ref.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


# --------------------------------------------------------------------------- cast cache


@pytest.mark.parametrize(("cache_enabled", "casts"), [(True, 1), (False, 3)])
def test_cache_casts_each_weight_once_per_region(cache_enabled, casts):
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with CastCounter(lin.weight) as c, mixprec.autocast(BF16, cache_enabled=cache_enabled):
        outs = [lin(x) for _ in range(3)]
    assert c.count == casts
    assert all(torch.equal(o, lin_ref(x, lin, BF16)) for o in outs)


def test_cache_separate_regions_cast_each_time():
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with CastCounter(lin.weight) as c:
        for _ in range(3):
            with mixprec.autocast(BF16):
                lin(x)
    assert c.count == 3


def test_cache_disabled_in_inner_region_only():
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with CastCounter(lin.weight) as c, mixprec.autocast(BF16):
        lin(x)
        with mixprec.autocast(BF16, cache_enabled=False):
            lin(x)
            lin(x)
        lin(x)  # cache back on: the entry from the first forward is reused
    assert c.count == 3


def test_cache_skips_inputs_without_grad():
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with CastCounter(x) as c, mixprec.autocast(BF16):
        for _ in range(3):
            lin(x)
    assert c.count == 3  # only leaves that require grad (the weights) are cached


def test_cache_invalidated_by_inplace_update():
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with CastCounter(lin.weight) as c, mixprec.autocast(BF16):
        before = lin(x)
        with torch.no_grad():
            lin.weight.add_(1.0)
        after = lin(x)
    assert c.count == 2
    assert torch.equal(after, lin_ref(x, lin, BF16))  # the new weights, never a stale copy
    assert not torch.equal(after, before)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=False),
        lambda ps: torch.optim.Adam(ps, lr=0.1),
    ],
    ids=["sgd-foreach", "sgd-loop", "adam"],
)
def test_cache_never_stale_after_optimizer_step_in_region(make_opt):
    lin, x = nn.Linear(5, 7), rn(2, 5)
    opt = make_opt(lin.parameters())
    with mixprec.autocast(BF16):
        for _ in range(3):
            y = lin(x)
            assert torch.equal(y, lin_ref(x, lin, BF16))  # always the current weights
            opt.zero_grad()
            y.float().pow(2).sum().backward()
            opt.step()


def test_cache_does_not_grow_under_no_grad():
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    n_params = len(list(model.parameters()))
    x = rn(2, 5)
    with CastCounter(*model.parameters()) as c, mixprec.autocast(BF16), torch.no_grad():
        for _ in range(50):
            y = model(x)
    assert c.count == n_params
    assert y.dtype == BF16


def test_no_grad_entry_not_handed_to_grad_forward():
    lin, x = nn.Linear(5, 7), rn(2, 5)
    with mixprec.autocast(BF16):
        with torch.no_grad():
            y0 = lin(x)
        assert y0.grad_fn is None
        y = lin(x)
        assert y.grad_fn is not None
    y.float().sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert lin.weight.grad.dtype == F32
    w2 = lin.weight.detach().clone().requires_grad_()
    F.linear(x.bfloat16(), w2.bfloat16(), lin.bias.detach().bfloat16()).float().sum().backward()
    assert torch.equal(lin.weight.grad, w2.grad)


def test_cached_cast_shared_by_forwards_backprops_into_each():
    lin, x = nn.Linear(3, 2), rn(4, 3)
    with mixprec.autocast(BF16):
        a, b = lin(x), lin(2 * x)
    (a.float().sum() + b.float().sum()).backward()
    w2 = lin.weight.detach().clone().requires_grad_()
    wb = w2.bfloat16()
    bb = lin.bias.detach().bfloat16()
    (
        F.linear(x.bfloat16(), wb, bb).float().sum()
        + F.linear((2 * x).bfloat16(), wb, bb).float().sum()
    ).backward()
    assert torch.equal(lin.weight.grad, w2.grad)


# --------------------------------------------------------------------------- module boundaries


class Probe(nn.Module):
    """A Linear that records its input dtype and the engine state it ran in."""

    def __init__(self, n: int = 4, fail: bool = False):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.fail = fail
        self.seen: list[tuple] = []

    def forward(self, x):
        self.seen.append((x.dtype, engine.is_active(), torch.is_autocast_enabled("cpu")))
        if self.fail:
            raise ValueError("forward failed")
        return self.lin(x)


def test_float32_submodule_inside_bf16_region():
    first, probe, last = nn.Linear(4, 4), Probe(), nn.Linear(4, 4)
    model = nn.Sequential(first, probe, last)
    set_policy(probe, "float32")
    x = rn(3, 4)
    mids = []
    probe.register_forward_hook(lambda m, a, out: mids.append(out))
    with mixprec.autocast(BF16):
        y = model(x)
        assert engine.is_active()
    h0 = lin_ref(x, first, BF16)
    h1 = F.linear(h0.float(), probe.lin.weight, probe.lin.bias)
    assert probe.seen == [(F32, False, False)]  # input cast to fp32, engine off inside
    assert mids[0].dtype == F32 and torch.equal(mids[0], h1)
    assert y.dtype == BF16 and torch.equal(y, lin_ref(h1, last, BF16))


def test_mixed_policy_outside_any_region():
    probe = Probe()
    set_policy(probe, "bf16-mixed")
    x = rn(3, 4).requires_grad_()
    y = probe(x)
    assert probe.seen == [(BF16, True, True)]
    assert y.dtype == F32  # output_dtype of a mixed policy
    assert torch.equal(y, lin_ref(x, probe.lin, BF16).float())
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
    y.sum().backward()
    assert x.grad.dtype == F32 and probe.lin.weight.grad.dtype == F32


def test_true_policy_returns_compute_dtype():
    probe = Probe()
    set_policy(probe, "bf16-true")
    y = probe(rn(2, 4))
    assert y.dtype == BF16 and probe.seen[0][0] == BF16


def test_nested_policies():
    inner = Probe()
    outer = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4))
    set_policy(outer, "bf16-mixed")
    set_policy(inner, "16-mixed")
    x = rn(2, 4)
    y = outer(x)
    assert inner.seen == [(F16, True, True)]
    h0 = lin_ref(x, outer[0], BF16)
    h1 = lin_ref(h0, inner.lin, F16).float()  # 16-mixed computes in fp16, returns fp32
    h2 = lin_ref(h1, outer[2], BF16)
    assert y.dtype == F32 and torch.equal(y, h2.float())
    assert not engine.is_active()


def test_policy_removed_with_none():
    probe = Probe()
    set_policy(probe, "bf16-mixed")
    set_policy(probe, None)
    x = rn(2, 4)
    y = probe(x)
    assert probe.seen == [(F32, False, False)] and torch.equal(y, probe.lin(x))


def test_boundary_pops_when_forward_raises_outside_region():
    probe = Probe(fail=True)
    set_policy(probe, "bf16-mixed")
    with pytest.raises(ValueError, match="forward failed"):
        probe(rn(2, 4))
    assert probe.seen == [(BF16, True, True)]
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")
    assert not _frames._state.frames


def test_boundary_pops_when_forward_raises_in_nested_boundaries_in_region():
    inner = Probe(fail=True)
    outer = nn.Sequential(nn.Linear(4, 4), inner)
    set_policy(outer, "16-mixed")
    set_policy(inner, "float32")
    with mixprec.autocast(BF16):
        with pytest.raises(ValueError):
            outer(rn(2, 4))
        # back in the bf16 region exactly
        assert engine.is_active() and len(_frames._state.frames) == 1
        assert torch.get_autocast_dtype("cpu") == BF16 and torch.is_autocast_enabled("cpu")
        assert nn.Linear(4, 4)(rn(2, 4)).dtype == BF16
    assert inner.seen == [(F32, False, False)]
    assert not engine.is_active() and not torch.is_autocast_enabled("cpu")


def test_boundary_shared_by_threads():
    """Two threads in the same policy'd module: each pops its own frame (A enters first and
    leaves first, while B is still inside)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    names = {}

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if names[threading.get_ident()] == "a":
                a_in.set()
                assert b_in.wait(10)
            else:
                b_in.set()
                assert a_out.wait(10)
            return self.lin(x)

    gate = set_policy(Gate(), "bf16-mixed")
    x = rn(2, 4)
    results, errors = {}, []

    def run(name, wait_for=None):
        names[threading.get_ident()] = name
        try:
            if wait_for is not None:
                assert wait_for.wait(10)
            results[name] = gate(x)
            results[name + "_after"] = (engine.is_active(), len(_frames._state.frames))
        except Exception as e:  # noqa: BLE001 - pragma: no cover - reported below
            errors.append(f"{name}: {e!r}")
        finally:
            if name == "a":
                a_out.set()

    ta = threading.Thread(target=run, args=("a",))
    tb = threading.Thread(target=run, args=("b", a_in))
    ta.start()
    tb.start()
    ta.join(20)
    tb.join(20)
    assert errors == []
    want = lin_ref(x, gate.lin, BF16).float()
    for name in "ab":
        assert results[name].dtype == F32 and torch.equal(results[name], want)
        assert results[name + "_after"] == (False, 0)


class DictOut(dict):
    """A dict subclass with attribute access, like transformers' ModelOutput."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        return DictOut(logits=h, probs=torch.softmax(h, -1), n=3)


def test_boundary_output_keeps_container_types():
    model = set_policy(DictModel(), "bf16-mixed")
    x = rn(2, 4)
    out = model(x)
    assert type(out) is DictOut and out.n == 3
    h = lin_ref(x, model.lin, BF16)
    assert out.logits.dtype == F32 and torch.equal(out.logits, h.float())
    assert out.probs.dtype == F32 and torch.equal(out.probs, torch.softmax(h.float(), -1))


def test_cast_tree_structures():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    t32, t64, ti = rn(2), rn(2, dtype=torch.float64), torch.arange(2)
    t16 = rn(2, dtype=F16)
    tree = {
        "p": Pair(t32, [t64, ti]),
        "o": OrderedDict(x=t16),
        "s": torch.Size([2, 3]),
        "m": t32.max(0),
        "n": None,
        "f": 1.5,
    }
    out = engine.cast_tree(tree, BF16)
    assert type(out["p"]) is Pair and out["p"].a.dtype == BF16
    assert out["p"].b[0] is t64 and out["p"].b[1] is ti  # fp64 and ints untouched
    assert type(out["o"]) is OrderedDict and out["o"]["x"].dtype == BF16
    assert out["s"] == torch.Size([2, 3]) and type(out["s"]) is torch.Size
    assert type(out["m"]) is type(t32.max(0)) and out["m"].values.dtype == BF16
    assert out["n"] is None and out["f"] == 1.5
    assert tree["p"].a.dtype == F32  # the input structure is not modified
    widened = engine.cast_tree([t32, t16, t64], F32, only_low=True)
    assert widened[0] is t32 and widened[1].dtype == F32 and widened[2] is t64


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_recurrent_and_composite_modules(dtype):
    lstm = nn.LSTM(4, 5, batch_first=True)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x, s = rn(2, 3, 4), rn(2, 3, 8)
    with mixprec.autocast(dtype):
        y, _ = lstm(x)
        a, _ = mha(s, s, s)
    assert y.dtype == dtype and a.dtype == dtype  # lowered, also inside the opaque composite
    (y.float().sum() + a.float().sum()).backward()
    for p in (*lstm.parameters(), *mha.parameters()):
        assert p.grad is not None and p.grad.dtype == F32 and torch.isfinite(p.grad).all()


def test_global_policy_does_not_affect_plain_calls():
    set_global_policy("bf16-mixed")
    lin = nn.Linear(4, 4)
    assert lin(rn(2, 4)).dtype == F32  # global policy only matters for autocast(None)


# --------------------------------------------------------------------------- attention kernels

ATTN_SHAPES = [
    ((2, 3, 16, 8), (2, 3, 16, 8)),
    ((2, 3, 5, 8), (2, 3, 9, 8)),
    ((2, 3, 9, 8), (2, 3, 5, 8)),
    ((4, 7, 8), (4, 7, 8)),
]


def qkv(q_shape, kv_shape, dtype=F32, seed=0):
    return (
        rn(*q_shape, seed=seed).to(dtype),
        rn(*kv_shape, seed=seed + 1).to(dtype),
        rn(*kv_shape, seed=seed + 2).to(dtype),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", ATTN_SHAPES, ids=str)
def test_decomposed_attention_fp32_matches_sdpa(causal, shapes):
    q, k, v = qkv(*shapes)
    ours = attention.decomposed_attention(q, k, v, is_causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert ours.shape == ref.shape and ours.dtype == F32
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_decomposed_attention_scale_and_value_width():
    q, k = rn(2, 5, 8, seed=1), rn(2, 6, 8, seed=2)
    v = rn(2, 6, 3, seed=3)
    for causal in (False, True):
        ours = attention.decomposed_attention(q, k, v, is_causal=causal, scale=0.3)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
        assert ours.shape == (2, 5, 3) and torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", ATTN_SHAPES[:3], ids=str)
def test_decomposed_attention_bf16_close_to_sdpa(causal, shapes):
    q, k, v = qkv(*shapes, dtype=BF16)
    ours = attention.decomposed_attention(q, k, v, is_causal=causal)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert ours.dtype == BF16
    assert (ours.float() - ref).abs().max().item() < 2e-2


def test_decomposed_attention_causal_is_not_the_full_attention():
    q, k, v = qkv((1, 1, 6, 4), (1, 1, 6, 4))
    causal = attention.decomposed_attention(q, k, v, is_causal=True)
    full = attention.decomposed_attention(q, k, v, is_causal=False)
    assert torch.allclose(causal[..., 0, :], v[..., 0, :])  # row 0 only sees key 0
    assert torch.allclose(causal[..., -1, :], full[..., -1, :], atol=1e-6)
    assert not torch.allclose(causal, full)


@pytest.mark.parametrize("causal", [False, True])
def test_decomposed_attention_gradients(causal):
    q, k, v = (t.requires_grad_() for t in qkv((2, 3, 6, 8), (2, 3, 6, 8), dtype=BF16))
    attention.decomposed_attention(q, k, v, is_causal=causal).float().sum().backward()
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).sum().backward()
    for t, ref in ((q, qf), (k, kf), (v, vf)):
        assert t.grad is not None and t.grad.dtype == BF16
        assert torch.isfinite(t.grad.float()).all()
        assert (t.grad.float() - ref.grad).abs().max().item() < 5e-2


def _plain_decomposition(q, k, v, is_causal=False, scale=None):
    """The decomposition written with autograd's own ops (saves its probabilities)."""
    L, E, S = q.shape[-2], q.shape[-1], k.shape[-2]
    alpha = scale if scale is not None else E**-0.5
    q3, k3, v3 = q.reshape(-1, L, E), k.reshape(-1, S, E), v.reshape(-1, S, v.shape[-1])
    if is_causal:
        bias = attention._causal_bias(L, S, q.dtype, q.device).expand(q3.shape[0], L, S)
        scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=alpha)
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(alpha)
    return torch.bmm(scores.softmax(-1), v3).view(*q.shape[:-1], v.shape[-1])


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_lean_attention_is_bitwise_the_plain_decomposition_across_chunks(
    causal, scale, monkeypatch
):
    monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", 3 * 16 * 16)  # 3 heads a chunk, 7 chunks
    heads = rn(2, 16, 3, 10, 8, seed=4).to(BF16)  # (batch, T, q/k/v, heads, head dim)
    grad = rn(2, 10, 16, 8, seed=5).to(BF16)
    results = []
    for f in (_plain_decomposition, attention.decomposed_attention):
        x = heads.clone().requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in x.unbind(2))  # non-contiguous, as in a GPT
        out = f(q, k, v, is_causal=causal, scale=scale)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    with torch.no_grad():
        q, k, v = (t.transpose(1, 2) for t in heads.unbind(2))
        no_grad = attention.decomposed_attention(q, k, v, is_causal=causal, scale=scale)
    (out0, g0), (out1, g1) = results
    assert torch.equal(out0, out1) and torch.equal(g0, g1) and torch.equal(no_grad, out0)


def test_lean_attention_saves_q_k_v_and_not_the_probabilities():
    x = rn(2, 64, 3, 4, 16, seed=6).to(BF16).requires_grad_()  # T 64 > head dim 16
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    for f, expected in ((_plain_decomposition, None), (attention.decomposed_attention, 3)):
        saved.clear()
        q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            f(q, k, v, is_causal=True)
        probs = 2 * 4 * 64 * 64
        if expected is None:
            assert probs in saved  # the plain decomposition keeps them
        else:
            assert sorted(saved) == [2 * 4 * 64 * 16] * expected  # q, k and v: 3/8 of probs


def test_lean_attention_has_a_second_derivative():
    q, k, v = (t.requires_grad_() for t in qkv((1, 2, 5, 4), (1, 2, 5, 4), dtype=F32))
    q.data, k.data, v.data = q.data.to(BF16), k.data.to(BF16), v.data.to(BF16)
    derivatives = []
    for f in (_plain_decomposition, attention.decomposed_attention):
        (gq,) = torch.autograd.grad(f(q, k, v, is_causal=True).square().sum(), q, create_graph=True)
        derivatives.append(torch.autograd.grad(gq.float().sum(), (k, v)))
    for a, b in zip(*derivatives):
        assert torch.isfinite(b.float()).all()
        assert (a.float() - b.float()).abs().max() <= 0.05 * a.float().abs().max()


def test_can_decompose_attention_conditions(decompose_small_attention):
    q, k, v = qkv((2, 3, 4, 8), (2, 3, 4, 8), dtype=BF16)
    ok = attention.can_decompose_attention
    assert not ok(q, k, v)  # inference: the fused kernel is faster forward-only
    q.requires_grad_()
    assert ok(q, k, v) and ok(q, k, v, is_causal=True, scale=0.5)
    with torch.no_grad():
        assert not ok(q, k, v)
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert not ok(q, k, v, attn_mask=mask)
    assert not ok(q, k, v, dropout_p=0.1)
    assert not ok(q, k, v, enable_gqa=True)
    assert not ok(q.float(), k.float(), v.float())
    assert not ok(q.half(), k.half(), v.half())
    assert not ok(q, k.float(), v)
    meta = [t.to("meta") for t in (q, k, v)]
    assert not ok(*meta)
    assert not ok(q[0, 0], k[0, 0], v[0, 0])  # 2-D
    assert not ok(q, k[:1], v[:1])  # batch dims differ
    assert not ok(q.tolist(), k, v)


def test_can_decompose_attention_from_the_measured_size_up():
    """Smaller attention is launch-bound: the fused kernel's one call beats the decomposition's
    extra kernels there. The size counts the multiply-adds of ``q @ k^T``."""
    at = attention.MIN_DECOMPOSED_WORK // (4 * 8)  # batch x heads 4, head size 8: L x S
    for L, S, decomposes in ((256, at // 256, True), (256, at // 256 - 1, False), (8, 8, False)):
        q = torch.zeros(2, 2, L, 8, dtype=BF16, requires_grad=True)
        k = v = torch.zeros(2, 2, S, 8, dtype=BF16)
        assert attention.can_decompose_attention(q, k, v) == decomposes, (L, S)
    small = torch.zeros(1, 2, 8, 16, dtype=BF16, requires_grad=True)
    with mixprec.autocast(BF16):
        out = F.scaled_dot_product_attention(small, small, small, is_causal=True)
    assert torch.equal(out, F.scaled_dot_product_attention(small, small, small, is_causal=True))
    assert out.grad_fn.name().startswith("ScaledDotProduct")  # torch's kernel, not mixprec's


def test_region_attention_fused_vs_auto(decompose_small_attention):
    q, k, v = qkv((2, 3, 8, 8), (2, 3, 8, 8))
    q.requires_grad_()  # training: "auto" decomposes (inference keeps the fused kernel)
    qb, kb, vb = q.detach().bfloat16(), k.bfloat16(), v.bfloat16()
    for causal in (False, True):
        with torch.no_grad(), mixprec.autocast(BF16):
            inference = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(inference, F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))
        with mixprec.autocast(mixprec.Recipe("O1", BF16, kernels="torch")):
            fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with mixprec.autocast(mixprec.Recipe("O1", BF16, kernels="auto")):
            auto = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want_fused = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
        want_auto = attention.decomposed_attention(qb, kb, vb, is_causal=causal)
        assert fused.dtype == auto.dtype == BF16
        assert torch.equal(fused, want_fused)
        assert torch.equal(auto, want_auto)


@pytest.mark.parametrize("causal", [False, True])
def test_region_attention_positional_arguments(causal, decompose_small_attention):
    q, k, v = qkv((2, 3, 8, 8), (2, 3, 8, 8))
    q.requires_grad_()
    with mixprec.autocast(BF16):
        positional = F.scaled_dot_product_attention(q, k, v, None, 0.0, causal)
        with_scale = F.scaled_dot_product_attention(q, k, v, None, 0.0, causal, scale=0.25)
    qb, kb, vb = q.detach().bfloat16(), k.bfloat16(), v.bfloat16()
    assert torch.equal(positional, attention.decomposed_attention(qb, kb, vb, is_causal=causal))
    assert torch.equal(
        with_scale, attention.decomposed_attention(qb, kb, vb, is_causal=causal, scale=0.25)
    )


def test_region_attention_keyword_tensors(decompose_small_attention):
    q, k, v = qkv((2, 3, 8, 8), (2, 3, 8, 8))
    v.requires_grad_()
    with mixprec.autocast(BF16):
        out = F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
    want = attention.decomposed_attention(
        q.bfloat16(), k.bfloat16(), v.detach().bfloat16(), is_causal=True
    )
    assert torch.equal(out, want)


def test_region_attention_keeps_fused_where_decomposition_does_not_apply():
    q, k, v = qkv((2, 3, 8, 8), (2, 3, 8, 8))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with mixprec.autocast(BF16):
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with mixprec.autocast(F16):
        half = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert torch.equal(masked, F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask))
    assert torch.equal(
        half, F.scaled_dot_product_attention(q.half(), k.half(), v.half(), is_causal=True)
    )


# --------------------------------------------------------------------------- model level


def test_gpt_bf16_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(2))
    with mixprec.autocast(BF16):
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, 32), targets.view(-1))
    assert logits.dtype == BF16 and logits.shape == (2, 16, 32)
    assert loss.dtype == F32 and torch.isfinite(loss)
    with torch.no_grad():
        ref = F.cross_entropy(model(idx).view(-1, 32), targets.view(-1))
    assert abs(loss.item() - ref.item()) < 0.05
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == F32, name
        assert torch.isfinite(p.grad).all(), name


# --------------------------------------------------------------------------- public surface


def test_public_names():
    names = mixprec.__all__
    assert len(names) == len(set(names))
    assert not [n for n in names if n.startswith("_")]
    for n in names:
        assert getattr(mixprec, n) is not None
    ns: dict = {}
    exec(f"from mixprec import {', '.join(names)}", ns)
    assert all(n in ns for n in names)


def test_import_does_not_initialize_cuda():
    code = (
        "import torch, mixprec, mixprec._core.engine, mixprec._core.attention\n"
        "import mixprec.bench.models\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'\n"
        "from mixprec import *\n"
        "print('ok', len(mixprec.__all__))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_promote_ops_accept_another_16bit_dtype_in_a_region():
    """torch.autocast's own promotion raises on float16 inputs in a bfloat16 region."""
    a = torch.randn(2, 3, dtype=torch.float16)
    with mixprec.autocast(torch.bfloat16):
        assert torch.cat([a, a]).dtype == torch.float16
        assert torch.cat([a, a.float()]).dtype == torch.float32
        assert torch.stack([a, a.to(torch.bfloat16)]).dtype == torch.float32


def test_boundary_casts_dataclass_and_pytree_outputs():
    import dataclasses

    from torch.utils import _pytree

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extras: list
        step: int = 0

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        hidden: torch.Tensor

    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    _pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return Out(y, [y, Frozen(y)], 3), Pair(y, y.double())

    net = Net()
    model, _ = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", BF16)
    out, pair = model(rn(2, 4))
    assert isinstance(out, Out) and out.step == 3
    assert out.logits.dtype == F32 and out.extras[0].dtype == F32
    assert isinstance(out.extras[1], Frozen) and out.extras[1].hidden.dtype == F32
    assert isinstance(pair, Pair) and pair.a.dtype == F32 and pair.b.dtype == torch.float64
