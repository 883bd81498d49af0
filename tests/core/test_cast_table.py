"""Tests for mixprec._core.cast_table as applied by the eager engine.

Every check compares the region's result *bitwise* (torch.equal) with a hand-written
cast-then-run reference computed outside any region.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._core import cast_table
from mixprec._core.cast_table import (
    FP32,
    LOWER,
    PROMOTE,
    cast_rules,
    op_name,
    register_op,
    rule_for,
)

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

LOW = [torch.bfloat16, torch.float16]
F32, F64 = torch.float32, torch.float64


@pytest.fixture(autouse=True)
def registry():
    """Snapshot the process-wide registrations and restore them after the test."""
    saved = dict(cast_table._user)
    yield cast_table._user
    cast_table._user.clear()
    cast_table._user.update(saved)
    cast_table._version[0] += 1
    assert not cast_table._scoped.scopes


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rn(*shape, dtype=F32, g=None, positive=False):
    t = torch.randn(*shape, generator=g or gen(sum(shape)))
    if positive:
        t = t.abs() + 0.5
    return t.to(dtype)


def cast(obj, dtype):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast(x, dtype) for x in obj)
    return obj


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.equal(actual, expected)


# --------------------------------------------------------------------------- lower


def _lower_cases():
    g = gen(1)
    x, w, b = rn(3, 4, g=g), rn(5, 4, g=g), rn(5, g=g)
    a, m = rn(3, 4, g=g), rn(4, 6, g=g)
    ba, bb = rn(2, 3, 4, g=g), rn(2, 4, 5, g=g)
    c1x, c1w, c1b = rn(1, 2, 7, g=g), rn(3, 2, 3, g=g), rn(3, g=g)
    c2x, c2w = rn(1, 2, 5, 5, g=g), rn(3, 2, 3, 3, g=g)
    return [
        ("F.linear", F.linear, (x, w, b)),
        ("torch.matmul", torch.matmul, (a, m)),
        ("Tensor.matmul", lambda a, m: a.matmul(m), (a, m)),
        ("__matmul__", lambda a, m: a @ m, (a, m)),
        ("torch.mm", torch.mm, (a, m)),
        ("Tensor.mm", lambda a, m: a.mm(m), (a, m)),
        ("torch.bmm", torch.bmm, (ba, bb)),
        ("torch.addmm", torch.addmm, (rn(3, 6, g=g), a, m)),
        ("torch.baddbmm", torch.baddbmm, (rn(2, 3, 5, g=g), ba, bb)),
        ("F.conv1d", F.conv1d, (c1x, c1w, c1b)),
        ("F.conv2d", lambda x, w: F.conv2d(x, w, padding=1), (c2x, c2w)),
        ("torch.einsum", lambda a, m: torch.einsum("ij,jk->ik", a, m), (a, m)),
        ("torch.einsum.batched", lambda p, q: torch.einsum("bij,bjk->bik", p, q), (ba, bb)),
    ]


LOWER_CASES = _lower_cases()


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("name", "fn", "args"), LOWER_CASES, ids=[c[0] for c in LOWER_CASES])
def test_lower_ops_fp32_inputs(dtype, name, fn, args):
    with mixprec.autocast(dtype):
        out = fn(*args)
    assert_same(out, fn(*cast(args, dtype)))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_lower_ops_mixed_input_dtypes(dtype):
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    x, w, b = rn(3, 4).to(other), rn(5, 4), rn(5).to(other)
    with mixprec.autocast(dtype):
        out = F.linear(x, w, b)
    assert_same(out, F.linear(x.to(dtype), w.to(dtype), b.to(dtype)))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_lower_nn_modules(dtype):
    lin, conv = nn.Linear(4, 5), nn.Conv2d(2, 3, 3)
    x, img = rn(3, 4), rn(1, 2, 5, 5)
    with mixprec.autocast(dtype):
        y, z = lin(x), conv(img)
    assert_same(y, F.linear(x.to(dtype), lin.weight.to(dtype), lin.bias.to(dtype)))
    assert_same(z, F.conv2d(img.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype)))


# --------------------------------------------------------------------------- fp32


def _fp32_cases():
    g = gen(2)
    x = rn(3, 5, g=g)
    pos = rn(3, 5, g=g, positive=True)
    ln_w, ln_b = rn(5, g=g), rn(5, g=g)
    target = torch.tensor([0, 4, 2])
    y32 = rn(3, 5, g=g)
    return [
        ("torch.softmax", lambda x: torch.softmax(x, -1), (x,), ()),
        ("Tensor.softmax", lambda x: x.softmax(dim=-1), (x,), ()),
        ("F.softmax", lambda x: F.softmax(x, dim=-1), (x,), ()),
        ("F.log_softmax", lambda x: F.log_softmax(x, -1), (x,), ()),
        ("torch.log_softmax", lambda x: torch.log_softmax(x, 0), (x,), ()),
        ("aten.softmax.int", lambda x: torch.ops.aten.softmax.int(x, -1), (x,), ()),
        ("F.layer_norm", lambda x, w, b: F.layer_norm(x, (5,), w, b), (x,), (ln_w, ln_b)),
        ("nn.LayerNorm-like", lambda x: F.layer_norm(x, (5,)), (x,), ()),
        ("torch.sum", torch.sum, (x,), ()),
        ("Tensor.sum.dim", lambda x: x.sum(-1), (x,), ()),
        ("Tensor.mean", lambda x: x.mean(), (x,), ()),
        ("torch.mean.dim", lambda x: torch.mean(x, 0), (x,), ()),
        ("torch.exp", torch.exp, (x,), ()),
        ("Tensor.exp", lambda x: x.exp(), (x,), ()),
        ("torch.log", torch.log, (pos,), ()),
        ("Tensor.log", lambda x: x.log(), (pos,), ()),
        ("torch.pow", lambda x: torch.pow(x, 3), (x,), ()),
        ("__pow__", lambda x: x**2, (x,), ()),
        ("F.cross_entropy", lambda x: F.cross_entropy(x, target), (x,), ()),
        ("F.mse_loss", F.mse_loss, (x,), (y32,)),
    ]


FP32_CASES = _fp32_cases()


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(
    ("name", "fn", "low_args", "f32_args"), FP32_CASES, ids=[c[0] for c in FP32_CASES]
)
def test_fp32_ops_16bit_inputs(dtype, name, fn, low_args, f32_args):
    low = cast(low_args, dtype)
    with mixprec.autocast(dtype):
        out = fn(*low, *f32_args)
    assert_same(out, fn(*cast(low, F32), *f32_args))


@pytest.mark.parametrize(
    ("name", "fn", "low_args", "f32_args"), FP32_CASES[::3], ids=[c[0] for c in FP32_CASES[::3]]
)
def test_fp32_ops_fp32_inputs_unchanged(name, fn, low_args, f32_args):
    with mixprec.autocast(torch.bfloat16):
        out = fn(*low_args, *f32_args)
    assert_same(out, fn(*low_args, *f32_args))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp32_op_inputs_that_are_16bit_leaves(dtype):
    # a 16-bit *parameter* (e.g. bf16-true storage) is widened too
    w = nn.Parameter(rn(4, dtype=dtype))
    x = rn(2, 4, dtype=dtype)
    with mixprec.autocast(dtype):
        out = F.layer_norm(x, (4,), w)
        s = w.sum()
    assert_same(out, F.layer_norm(x.float(), (4,), w.detach().float()))
    assert_same(s, w.detach().float().sum())


# --------------------------------------------------------------------------- promote


def _promote_cases():
    g = gen(3)
    a, b = rn(3, 4, g=g), rn(3, 4, g=g)
    cond = rn(3, 4, g=g) > 0
    return [
        ("torch.add", torch.add, (a, b)),
        ("__add__", lambda a, b: a + b, (a, b)),
        ("__radd__-order", lambda a, b: b + a, (a, b)),
        ("torch.sub", torch.sub, (a, b)),
        ("torch.mul", torch.mul, (a, b)),
        ("__mul__", lambda a, b: a * b, (a, b)),
        ("torch.div", torch.div, (a, b)),
        ("torch.cat", lambda a, b: torch.cat([a, b]), (a, b)),
        ("torch.cat.dim1", lambda a, b: torch.cat((a, b), dim=1), (a, b)),
        ("torch.stack", lambda a, b: torch.stack([a, b]), (a, b)),
        ("torch.where", lambda a, b: torch.where(cond, a, b), (a, b)),
        ("torch.maximum", torch.maximum, (a, b)),
        ("torch.lt", torch.lt, (a, b)),
    ]


PROMOTE_CASES = _promote_cases()


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("name", "fn", "args"), PROMOTE_CASES, ids=[c[0] for c in PROMOTE_CASES])
def test_promote_16bit_with_fp32(dtype, name, fn, args):
    a, b = args
    a16 = a.to(dtype)
    with mixprec.autocast(dtype):
        out = fn(a16, b)
        out_rev = fn(b, a16)
    assert_same(out, fn(a16.float(), b))
    assert_same(out_rev, fn(b, a16.float()))
    if out.is_floating_point():
        assert out.dtype == F32


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(
    ("name", "fn", "args"), PROMOTE_CASES[::2], ids=[c[0] for c in PROMOTE_CASES[::2]]
)
def test_promote_same_dtype_stays(dtype, name, fn, args):
    a, b = cast(args, dtype)
    with mixprec.autocast(dtype):
        out = fn(a, b)
    assert_same(out, fn(a, b))


def test_promote_add_example_from_brief():
    a, b = rn(4, dtype=torch.bfloat16), rn(4)
    with mixprec.autocast(torch.bfloat16):
        out = torch.add(a, b)
    assert out.dtype == F32 and torch.equal(out, a.float() + b)


@pytest.mark.parametrize("region", LOW, ids=str)
def test_fp16_bf16_mix_goes_to_fp32(region):
    a, b = rn(2, 3, dtype=torch.float16), rn(2, 3, dtype=torch.bfloat16)
    with mixprec.autocast(region):
        cat = torch.cat([a, b])
        stack = torch.stack([a, b])
        add = a + b
        where = torch.where(a > 0, a, b)
    assert_same(cat, torch.cat([a.float(), b.float()]))
    assert_same(stack, torch.stack([a.float(), b.float()]))
    assert_same(add, a.float() + b.float())
    assert_same(where, torch.where(a > 0, a.float(), b.float()))


def test_torch_autocast_rejects_the_fp16_bf16_mix():
    """Documents the improvement: torch.autocast raises where mixprec promotes to fp32."""
    a, b = rn(2, 3, dtype=torch.float16), rn(2, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(RuntimeError):
        torch.cat([a, b])
    with mixprec.autocast(torch.bfloat16):
        assert torch.cat([a, b]).dtype == F32


def test_promote_with_fp64_follows_torch():
    a, b = rn(3, dtype=torch.bfloat16), rn(3, dtype=F64)
    with mixprec.autocast(torch.bfloat16):
        out = torch.add(a, b)
        cat = torch.cat([b, a.double()])
    assert_same(out, torch.add(a, b))
    assert out.dtype == F64 and cat.dtype == F64


# --------------------------------------------------------------------------- pass-through


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("relu", torch.relu),
        ("F.relu", F.relu),
        ("F.gelu", F.gelu),
        ("tanh", torch.tanh),
        ("view", lambda x: x.view(-1)),
        ("transpose", lambda x: x.t()),
        ("neg", lambda x: -x),
        ("scalar_mul", lambda x: x * 2.0),
        ("abs", torch.abs),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unlisted_ops_keep_input_dtype(dtype, name, fn):
    x32 = rn(3, 4)
    x16 = x32.to(dtype)
    with mixprec.autocast(dtype):
        o32, o16 = fn(x32), fn(x16)
    assert_same(o32, fn(x32))
    assert_same(o16, fn(x16))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp64_passes_through(dtype):
    x, w, b = rn(3, 4, dtype=F64), rn(5, 4, dtype=F64), rn(5, dtype=F64)
    lin = nn.Linear(4, 5).double()
    with mixprec.autocast(dtype):
        outs = [
            F.linear(x, w, b),
            torch.mm(x, w.t()),
            torch.softmax(x, -1),
            x.sum(),
            x @ w.t(),
            lin(x),
            torch.cat([x, x]),
            F.layer_norm(x, (4,)),
        ]
    refs = [
        F.linear(x, w, b),
        torch.mm(x, w.t()),
        torch.softmax(x, -1),
        x.sum(),
        x @ w.t(),
        lin(x),
        torch.cat([x, x]),
        F.layer_norm(x, (4,)),
    ]
    for out, ref in zip(outs, refs):
        assert_same(out, ref)
        assert out.dtype == F64


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_integer_tensors_pass_through(dtype):
    a = torch.arange(12).view(3, 4)
    b = torch.arange(8, dtype=torch.int32).view(4, 2)
    with mixprec.autocast(dtype):
        outs = [
            torch.mm(a, a.t()),
            a @ a.t(),
            a.sum(),
            torch.add(a, a),
            torch.cat([a, a]),
            a.cumsum(0),
            torch.matmul(b.t(), b),
            a * 3,
            torch.where(a > 3, a, 0),
        ]
    refs = [
        torch.mm(a, a.t()),
        a @ a.t(),
        a.sum(),
        torch.add(a, a),
        torch.cat([a, a]),
        a.cumsum(0),
        torch.matmul(b.t(), b),
        a * 3,
        torch.where(a > 3, a, 0),
    ]
    for out, ref in zip(outs, refs):
        assert_same(out, ref)
        assert not out.is_floating_point()


# ------------------------------------------------------------------------ in-place, out=, dtype=


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_inplace_on_fp32_never_downcast(dtype):
    y16 = rn(3, 4, dtype=dtype)
    base = rn(3, 4, g=gen(9))
    results = {}
    with mixprec.autocast(dtype):
        x = base.clone()
        x.add_(y16)
        results["add_"] = x
        x = base.clone()
        x.mul_(y16)
        results["mul_"] = x
        x = base.clone()
        x += y16
        results["iadd"] = x
        x = base.clone()
        x *= y16
        results["imul"] = x
        x = base.clone()
        x[0] = y16[0]
        results["setitem"] = x
        x = base.clone()
        x.copy_(y16)
        results["copy_"] = x
        x = base.clone()
        x.exp_()
        results["exp_"] = x
        x = base.clone()
        x.softmax(-1)
        results["noop"] = x
    refs = {}
    x = base.clone()
    x.add_(y16.float())
    refs["add_"] = x
    x = base.clone()
    x.mul_(y16.float())
    refs["mul_"] = x
    refs["iadd"], refs["imul"] = refs["add_"], refs["mul_"]
    x = base.clone()
    x[0] = y16[0].float()
    refs["setitem"] = x
    refs["copy_"] = y16.float()
    refs["exp_"] = base.exp()
    refs["noop"] = base
    for key in refs:
        assert results[key].dtype == F32, key
        assert torch.equal(results[key], refs[key]), key


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_inplace_on_16bit_stays_16bit(dtype):
    x = rn(3, 4, dtype=dtype)
    ref = x.clone().exp_().add_(1.0)
    with mixprec.autocast(dtype):
        x.exp_().add_(1.0)
    assert_same(x, ref)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_out_variants_are_never_downcast(dtype):
    a, m = rn(3, 4), rn(4, 5)
    a16 = a.to(dtype)
    o_mm, o_add, o_cat, o_sum = (
        torch.empty(3, 5),
        torch.empty(3, 4),
        torch.empty(6, 4),
        torch.empty(4),
    )
    with mixprec.autocast(dtype):
        torch.mm(a, m, out=o_mm)
        torch.add(a16, a, out=o_add)
        torch.cat([a, a16.float()], out=o_cat)
        torch.sum(a, 0, out=o_sum)
    assert_same(o_mm, torch.mm(a, m))
    assert_same(o_add, a16.float() + a)
    assert_same(o_cat, torch.cat([a, a16.float()]))
    assert_same(o_sum, a.sum(0))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_explicit_dtype_is_kept(dtype):
    x16 = rn(3, 4, dtype=dtype)
    x32 = rn(3, 4)
    with mixprec.autocast(dtype):
        s = x16.sum(dtype=dtype)
        s64 = x32.sum(dtype=F64)
        m = torch.mean(x16, 0, dtype=dtype)
        sm = torch.softmax(x16, -1, dtype=dtype)
        sm_kw = F.softmax(x32, dim=-1, dtype=dtype)
        cs = x16.cumsum(0, dtype=dtype)
    assert_same(s, x16.sum(dtype=dtype))
    assert_same(s64, x32.sum(dtype=F64))
    assert_same(m, torch.mean(x16, 0, dtype=dtype))
    assert_same(sm, torch.softmax(x16, -1, dtype=dtype))
    assert_same(sm_kw, F.softmax(x32, dim=-1, dtype=dtype))
    assert_same(cs, x16.cumsum(0, dtype=dtype))


# --------------------------------------------------------------------------- names and lookup


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (torch.ops.aten.mm.default, ("mm", False)),
        (torch.ops.aten.softmax.int, ("softmax", False)),
        (torch.ops.aten.softmax, ("softmax", False)),
        (torch.ops.aten.add_.Tensor, ("add", True)),
        (torch.Tensor.add_, ("add", True)),
        (torch.Tensor.add, ("add", False)),
        (torch.Tensor.__matmul__, ("matmul", False)),
        (torch.Tensor.__rmatmul__, ("matmul", False)),
        (torch.Tensor.__radd__, ("add", False)),
        (torch.Tensor.__iadd__, ("__iadd__", True)),
        (torch.Tensor.__setitem__, ("__setitem__", True)),
        (torch.softmax, ("softmax", False)),
        (torch.Tensor.softmax, ("softmax", False)),
        (F.softmax, ("softmax", False)),
        (F.linear, ("linear", False)),
        (torch._softmax, ("_softmax", False)),
        ("layer_norm", ("layer_norm", False)),
        ("relu_", ("relu", True)),
    ],
)
def test_op_name(op, expected):
    assert op_name(op) == expected


@pytest.mark.parametrize(
    ("op", "rule"),
    [
        (torch.mm, LOWER),
        (F.linear, LOWER),
        (torch.Tensor.__matmul__, LOWER),
        (F.scaled_dot_product_attention, LOWER),
        (F.conv2d, LOWER),
        (torch.einsum, LOWER),
        (torch.softmax, FP32),
        (torch.Tensor.softmax, FP32),
        (F.layer_norm, FP32),
        (F.cross_entropy, FP32),
        (torch.Tensor.sum, FP32),
        (torch.exp, FP32),
        (torch.add, PROMOTE),
        (torch.cat, PROMOTE),
        (torch.where, PROMOTE),
        (torch.Tensor.__add__, PROMOTE),
        (torch.relu, None),
        (F.gelu, None),
        (torch.Tensor.view, None),
        (torch.Tensor.add_, None),
        (torch.Tensor.__iadd__, None),
    ],
)
def test_default_rules(op, rule):
    assert rule_for(op) == rule


def test_table_markdown_lists_every_default_op():
    md = cast_table.table_markdown()
    for name in cast_table.DEFAULT_TABLE:
        assert f"`{name}`" in md
    assert "| lower | matmul |" in md and "| fp32 | softmax |" in md


# --------------------------------------------------------------------------- register_op


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_register_op_fp32_then_none(dtype):
    x = rn(3, 4, dtype=dtype)
    register_op(torch.relu, "fp32")
    assert rule_for(torch.relu) == FP32 and rule_for(F.relu) == FP32
    with mixprec.autocast(dtype):
        a, b = torch.relu(x), F.relu(x)
    assert_same(a, torch.relu(x.float()))
    assert_same(b, torch.relu(x.float()))
    assert torch.relu(x).dtype == dtype  # outside a region nothing changes
    register_op(torch.relu, None)
    assert rule_for(torch.relu) is None
    with mixprec.autocast(dtype):
        assert_same(torch.relu(x), torch.relu(x))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_opting_out_of_a_lowered_op_runs_it_in_input_dtype(dtype):
    """None means "input dtype" even for ops torch.autocast (kept on underneath) would lower."""
    a, m, w = rn(3, 4), rn(4, 5), rn(5, 4)
    with cast_rules({torch.mm: None}), mixprec.autocast(dtype):
        mm32, mm16 = torch.mm(a, m), torch.mm(a.to(dtype), m.to(dtype))
        lin = F.linear(a, w)  # other lowered ops are unaffected
    assert_same(mm32, torch.mm(a, m))
    assert_same(mm16, torch.mm(a.to(dtype), m.to(dtype)))
    assert_same(lin, F.linear(a.to(dtype), w.to(dtype)))
    register_op(F.linear, None)
    with mixprec.autocast(dtype):
        assert_same(F.linear(a, w), F.linear(a, w))
        assert_same(
            nn.functional.linear(a.to(dtype), w.to(dtype)), F.linear(a.to(dtype), w.to(dtype))
        )


def test_register_op_takes_effect_inside_an_open_region():
    x = rn(3, 4, dtype=torch.bfloat16)
    with mixprec.autocast(torch.bfloat16):
        assert F.gelu(x).dtype == torch.bfloat16
        register_op(F.gelu, "fp32")
        assert_same(F.gelu(x), F.gelu(x.float()))


def test_register_op_aten_overload_covers_all_spellings():
    x = rn(3, 4)
    register_op(torch.ops.aten.softmax.int, "lower")
    assert rule_for(torch.softmax) == LOWER and rule_for(F.softmax) == LOWER
    with mixprec.autocast(torch.bfloat16):
        outs = [torch.softmax(x, -1), x.softmax(-1), F.softmax(x, dim=-1)]
    for out in outs:
        assert_same(out, torch.softmax(x.bfloat16(), -1))


def test_register_op_by_name_and_promote():
    a, b = rn(3, dtype=torch.bfloat16), rn(3)
    register_op("atan2", "promote")
    register_op(torch.Tensor.__mul__, None)  # dunder resolves to "mul": unlisted now
    with mixprec.autocast(torch.bfloat16):
        at = torch.atan2(a, b)
        mul = a * a
    assert_same(at, torch.atan2(a.float(), b))
    assert_same(mul, a * a)
    assert rule_for(torch.mul) is None


def test_register_op_is_process_wide():
    register_op(torch.tanh, "fp32")
    seen = []
    t = threading.Thread(target=lambda: seen.append(rule_for(torch.tanh)))
    t.start()
    t.join()
    assert seen == [FP32]


def test_register_op_bad_rule():
    before = dict(cast_table._user)
    for bad in ("bf16", "LOWER", 16, "fp16"):
        with pytest.raises(ValueError) as info:
            register_op(torch.relu, bad)
        msg = str(info.value)
        assert repr(bad) in msg
        assert "lower" in msg and "fp32" in msg and "promote" in msg
    assert cast_table._user == before
    assert rule_for(torch.relu) is None


@pytest.mark.parametrize("bad", [42, object(), None, 3.5])
def test_register_op_bad_op_type(bad):
    with pytest.raises(TypeError):
        register_op(bad, "fp32")


# --------------------------------------------------------------------------- cast_rules


def test_cast_rules_scopes_and_restores():
    x = rn(3, 4)
    with mixprec.autocast(torch.bfloat16):
        assert_same(torch.softmax(x, -1), torch.softmax(x, -1))
        with cast_rules({torch.softmax: "lower", "gelu": "fp32"}):
            assert rule_for(torch.softmax) == LOWER
            assert_same(torch.softmax(x, -1), torch.softmax(x.bfloat16(), -1))
            xb = x.bfloat16()
            assert_same(F.gelu(xb), F.gelu(xb.float()))
        assert rule_for(torch.softmax) == FP32 and rule_for(F.gelu) is None
        assert_same(torch.softmax(x, -1), torch.softmax(x, -1))


def test_cast_rules_restores_on_exception():
    with pytest.raises(ZeroDivisionError), cast_rules({torch.softmax: "lower"}):
        assert rule_for(torch.softmax) == LOWER
        raise ZeroDivisionError
    assert rule_for(torch.softmax) == FP32


def test_cast_rules_none_makes_op_unlisted():
    x = rn(3, 4, dtype=torch.bfloat16)
    with cast_rules({torch.softmax: None}), mixprec.autocast(torch.bfloat16):
        out = torch.softmax(x, -1)
    assert_same(out, torch.softmax(x, -1))


def test_cast_rules_beats_register_op_and_nests():
    register_op(torch.softmax, "promote")
    with cast_rules({torch.softmax: "lower"}):
        with cast_rules({torch.softmax: "fp32"}):
            assert rule_for(torch.softmax) == FP32
            with cast_rules({torch.softmax: "lower"}):  # equal to the outermost scope
                assert rule_for(torch.softmax) == LOWER
            # must pop *this* innermost scope, not the equal outermost one
            assert rule_for(torch.softmax) == FP32
        assert rule_for(torch.softmax) == LOWER
    assert rule_for(torch.softmax) == PROMOTE


def test_cast_rules_bad_rule_pushes_nothing():
    with pytest.raises(ValueError), cast_rules({torch.softmax: "fast"}):
        pass  # pragma: no cover
    assert not cast_table._scoped.scopes and rule_for(torch.softmax) == FP32
    with pytest.raises(TypeError), cast_rules({42: "fp32"}):
        pass  # pragma: no cover


def test_cast_rules_is_thread_local():
    x = rn(3, 4)
    entered, release = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        seen["rule"] = rule_for(torch.softmax)
        with mixprec.autocast(torch.bfloat16):
            seen["out"] = torch.softmax(x, -1)
        with cast_rules({torch.softmax: "promote"}):
            seen["own"] = rule_for(torch.softmax)
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with cast_rules({torch.softmax: "lower"}):
        entered.set()
        release.wait(10)
        assert rule_for(torch.softmax) == LOWER  # the other thread's scope did not leak here
    t.join(10)
    assert seen["rule"] == FP32 and seen["own"] == PROMOTE
    assert_same(seen["out"], torch.softmax(x, -1))
