"""CPU autocast conformance: torch.autocast's documented behaviour, checked against ``torch.amp``
(control) and ``mixprec.amp`` (the ``A`` fixture, conftest.py).

The behaviours are those PyTorch's own CPU autocast tests check: the op lists (every op of
torch's wheel-shipped ``AutocastCPUTestLists`` gives the listed dtype, bit for bit what casting
the inputs by hand and running the op gives, and what ``torch.autocast`` gives), the weight-cast
cache, nesting and ``enabled``, dtype defaults, argument errors, ``custom_fwd``/``custom_bwd``,
checkpointing, and the inputs autocast leaves alone. The tests are mixprec's own."""

from __future__ import annotations

import collections.abc
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# -- the op lists ----------------------------------------------------------------------------------
@dataclass
class OpCase:
    op: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    module: Any = torch  # None: only the Tensor method is called
    amp_dtype: torch.dtype = BF16
    run_as: torch.dtype | None = BF16  # the dtype the inputs are cast to; None: not cast
    out_type: torch.dtype = BF16


def _op_cases() -> list:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lists = AutocastCPUTestLists("cpu")
    cases = []

    def add(group, entry, **how):
        op, args, kwargs = entry[0], entry[1], entry[2] if len(entry) > 2 else {}
        case = OpCase(op, args, kwargs, **how)
        cases.append(pytest.param(case, id=f"{group}-{op}-{str(case.amp_dtype)[6:]}"))

    for amp_dtype in (BF16, FP16):  # lower precision: float32 inputs, the autocast dtype out
        how = {"amp_dtype": amp_dtype, "run_as": amp_dtype, "out_type": amp_dtype}
        for entry in lists.torch_16:
            add("torch_16", entry, **how)
        for entry in lists.nn_16:
            add("nn_16", entry, module=torch._C._nn, **how)
    for entry in lists.torch_fp32:  # float32: bfloat16 inputs, float32 out
        add("torch_fp32", entry, run_as=FP32, out_type=FP32)
    for entry in lists.nn_fp32:
        add("nn_fp32", entry, module=torch._C._nn, run_as=FP32, out_type=FP32)
    for op, args_bf16, args_fp16 in lists.torch_need_autocast_promote:  # a 16-bit/fp32 mix
        for amp_dtype, args in ((BF16, args_bf16), (FP16, args_fp16)):
            add("promote", (op, args), amp_dtype=amp_dtype, run_as=FP32, out_type=FP32)
    builtin = {  # ops that promote by themselves: inputs left as they are
        "torch_builtin": (lists.torch_expect_builtin_promote, torch),
        "methods_builtin": (lists.methods_expect_builtin_promote, None),
    }
    for group, (entries, module) in builtin.items():
        for op, args_bf16, args_fp16, out in entries:
            for amp_dtype, args in ((BF16, args_bf16), (FP16, args_fp16)):
                how = {"module": module, "amp_dtype": amp_dtype, "run_as": None, "out_type": out}
                add(group, (op, args), **how)
    return cases


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _call(case: OpCase, args) -> list:
    """The module function and the Tensor method, each where it exists."""
    outs = []
    if case.module is not None and hasattr(case.module, case.op):
        outs.append(getattr(case.module, case.op)(*args, **case.kwargs))
    if hasattr(torch.Tensor, case.op):
        outs.append(getattr(args[0], case.op)(*args[1:], **case.kwargs))
    return outs


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, collections.abc.Sequence):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)] if isinstance(out, (list, tuple)) else []


@pytest.mark.parametrize("case", _op_cases())
def test_listed_op_runs_in_the_listed_dtype_exactly_as_cast_then_run(A, case):
    assert not torch.is_autocast_enabled("cpu")
    with A.autocast("cpu", dtype=case.amp_dtype):
        assert torch.is_autocast_enabled("cpu")
        outs = _call(case, case.args)
    assert not torch.is_autocast_enabled("cpu")
    assert outs, f"{case.op} is neither a function of {case.module} nor a Tensor method"
    for out in outs:
        assert [t.dtype for t in _tensors(out)] == [case.out_type] * len(_tensors(out))
    assert all(_same(out, outs[0]) for out in outs)  # function and method agree
    with torch.autocast("cpu", enabled=False):  # by hand: cast the inputs, then run
        args = case.args if case.run_as is None else _cast(case.args, case.run_as)
        expected = _call(case, args)[0]
    assert _same(outs[0], expected)
    with torch.autocast("cpu", dtype=case.amp_dtype):  # and what torch.autocast gives, again
        assert _same(outs[0], _call(case, case.args)[0])


# -- the weight-cast cache -------------------------------------------------------------------------
class CastCounter(TorchDispatchMode):
    """Counts the casts of one tensor, seen below autocast: ``_to_copy`` (``to`` under
    inference mode, where it is not decomposed)."""

    CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.watched, self.n = watched, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.CASTS and args and args[0] is self.watched:
            self.n += 1
        return func(*args, **(kwargs or {}))


def casts(watched: torch.Tensor, fn) -> int:
    with CastCounter(watched) as counter:
        fn()
    return counter.n


def weight() -> torch.Tensor:
    return torch.randn(4, 4, requires_grad=True)  # a leaf: what the cache keeps


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


def _one_region(A, w, **kw):
    with A.autocast("cpu", BF16, **kw):
        for _ in range(3):
            torch.mm(X, w)


def _three_regions(A, w):
    for _ in range(3):
        with A.autocast("cpu", BF16):
            torch.mm(X, w)


def _under(context):
    def uses(A, w):
        with A.autocast("cpu", BF16), context():
            for _ in range(3):
                torch.mm(X, w)

    return uses


CACHE_CASES = {
    # name: (the tensor multiplied three times, how, casts expected)
    "one-region": (weight, _one_region, 1),
    "three-regions": (weight, _three_regions, 3),
    "cache_enabled=False": (weight, lambda A, w: _one_region(A, w, cache_enabled=False), 3),
    "under-no_grad": (weight, _under(torch.no_grad), 1),
    "under-inference_mode": (weight, _under(torch.inference_mode), 3),
    "no-requires_grad": (lambda: torch.randn(4, 4), _one_region, 3),
    "a-view": (lambda: weight().t(), _one_region, 3),
    "not-a-leaf": (lambda: weight() * 1, _one_region, 3),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_a_leaf_weight_is_cast_once_per_region_and_nothing_else_is_cached(A, case):
    make, uses, expected = CACHE_CASES[case]
    w = make()
    assert casts(w, lambda: uses(A, w)) == expected


def test_the_cache_lives_until_the_outermost_region_exits(A):
    w = weight()
    seen = []

    def run():
        with A.autocast("cpu", BF16):
            torch.mm(X, w)
            seen.append(counter.n)
            with A.autocast("cpu", BF16):  # nested: the same cache
                torch.mm(X, w)
            seen.append(counter.n)
            torch.mm(X, w)  # an inner exit keeps it
            seen.append(counter.n)
        with A.autocast("cpu", BF16):  # the outermost exit cleared it
            torch.mm(X, w)
        seen.append(counter.n)

    with CastCounter(w) as counter:
        run()
    assert seen == [1, 1, 1, 2]


def test_the_cache_serves_the_backward_run_inside_the_region(A):
    """A custom Function multiplies by the weight in forward and again in backward (re-entered
    autocast, custom_bwd): one region's cache is shared by both, and only while it lasts."""

    class MatMul(torch.autograd.Function):
        @staticmethod
        @A.custom_fwd(device_type="cpu")
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.mm(x, w)

        @staticmethod
        @A.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return torch.mm(w, grad.t()).t(), torch.mm(x.t(), grad)

    x, w = torch.randn(2, 4, requires_grad=True), weight()

    def backward_inside():
        with A.autocast("cpu", BF16):
            MatMul.apply(x, w).float().sum().backward()

    def backward_outside():
        with A.autocast("cpu", BF16):
            out = MatMul.apply(x, w)
        out.float().sum().backward()

    assert casts(w, backward_inside) == 1
    assert casts(w, backward_outside) == 2
    assert w.grad.dtype == FP32 and x.grad.dtype == FP32


def test_a_tensor_registered_as_cached_is_not_cached_by_autocast(A):
    w = weight()
    torch._C._set_cached_tensors_enabled(True)
    try:
        torch._C._add_cached_tensor(w)
        try:
            assert casts(w, lambda: _one_region(A, w)) == 3
        finally:
            torch._C._remove_cached_tensor(w)
    finally:
        torch._C._set_cached_tensors_enabled(False)


def test_leaving_no_grad_inside_a_region_gives_outputs_that_track_gradients(A):
    lin = nn.Linear(4, 4)
    with A.autocast("cpu", BF16):
        with torch.no_grad():
            frozen = lin(X)
        outs = [lin(X), lin(X)]
        with torch.no_grad():
            lin(X)
        outs.append(lin(X))
    assert not frozen.requires_grad and frozen.grad_fn is None
    assert all(o.requires_grad and o.grad_fn is not None and o.dtype == BF16 for o in outs)
    sum(o.float().sum() for o in outs).backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


@pytest.mark.parametrize("order", ["autocast-outside", "autocast-inside"])
def test_inference_mode_and_autocast_nest_either_way(A, order):
    lin = nn.Linear(4, 4)
    if order == "autocast-outside":
        with A.autocast("cpu", BF16):
            with torch.inference_mode():
                out = lin(X)
            after = lin(X)  # still in the region, out of inference mode
    else:
        with torch.inference_mode(), A.autocast("cpu", BF16):
            out = lin(X)
        with A.autocast("cpu", BF16):
            after = lin(X)
    assert out.dtype == BF16 and out.is_inference() and not out.requires_grad
    assert after.dtype == BF16 and after.requires_grad
    after.float().sum().backward()
    assert lin.weight.grad is not None


# -- nesting, enabled, state -----------------------------------------------------------------------
def state() -> tuple:
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


def mm_dtype() -> torch.dtype:
    return torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype


def test_regions_nest_and_each_exit_restores_the_state_it_found(A):
    outside = state()
    assert outside == (False, BF16, True) and mm_dtype() == FP32
    seen = []
    with A.autocast("cpu", BF16):
        seen.append((state(), mm_dtype()))
        with A.autocast("cpu", enabled=False):
            seen.append((state()[0], mm_dtype()))
        seen.append((state(), mm_dtype()))
        with A.autocast("cpu", FP16, cache_enabled=False):
            seen.append((state(), mm_dtype()))
        seen.append((state(), mm_dtype()))
    assert seen == [
        ((True, BF16, True), BF16),
        (False, FP32),
        ((True, BF16, True), BF16),
        ((True, FP16, False), FP16),
        ((True, BF16, True), BF16),
    ]
    assert state() == outside and mm_dtype() == FP32


def test_a_region_left_by_an_exception_restores_the_state(A):
    with pytest.raises(KeyError), A.autocast("cpu", FP16, cache_enabled=False):
        raise KeyError
    assert state() == (False, BF16, True)


def test_a_region_works_as_a_decorator(A):
    @A.autocast("cpu")
    def f(a, b):
        assert torch.is_autocast_enabled("cpu")
        return torch.mm(a, b)

    assert f(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16
    assert not torch.is_autocast_enabled("cpu")


def test_an_unsupported_dtype_warns_and_disables_the_region(A):
    message = (
        "In CPU autocast, but the target dtype is not supported. Disabling autocast.\n"
        "CPU Autocast only supports dtypes of torch.bfloat16, torch.float16 currently."
    )
    with pytest.warns(UserWarning, match=exactly(message)):
        region = A.autocast("cpu", dtype=FP32)
    with region:
        assert not torch.is_autocast_enabled("cpu") and mm_dtype() == FP32


def test_a_disabled_region_accepts_any_dtype_silently(A):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with A.autocast("cpu", dtype=FP32, enabled=False):
            assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(("device", "dtype"), [("cpu", BF16), ("cuda", FP16)])
def test_dtype_defaults_to_the_devices_autocast_dtype(A, device, dtype):
    assert A.autocast(device, enabled=False).fast_dtype == dtype == torch.get_autocast_dtype(device)


def test_the_cpu_default_is_bfloat16_inside_the_region(A):
    with A.autocast("cpu"):
        assert torch.get_autocast_dtype("cpu") == BF16 and mm_dtype() == BF16


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")
def test_a_cuda_region_without_cuda_warns_and_disables_itself(A):
    message = "CUDA is not available or torch_xla is imported. Disabling autocast."
    with pytest.warns(UserWarning, match=exactly(message)):
        region = A.autocast("cuda")
    with region:
        assert not torch.is_autocast_enabled("cuda")


ARGUMENT_ERRORS = {
    "a-torch.device": (
        lambda A: A.autocast(torch.device("cpu")),
        ValueError,
        exactly("Expected `device_type` of type `str`, got: `<class 'torch.device'>`"),
    ),
    "an-invalid-device-string": (
        lambda A: A.autocast("not a real device"),
        RuntimeError,
        exactly("Invalid device string: 'not a real device'"),
    ),
    "decorating-a-tensor": (
        lambda A: A.autocast("cpu")(torch.ones(1)),
        TypeError,
        "^" + re.escape("autocast()(func) requires a callable, but got Tensor."),
    ),
    "custom_fwd-with-a-torch.device": (
        lambda A: A.custom_fwd(device_type=torch.device("cpu")),
        ValueError,
        exactly("Expected `device_type` of type `str`, got: `<class 'torch.device'>`"),
    ),
    "custom_bwd-with-a-torch.device": (
        lambda A: A.custom_bwd(device_type=torch.device("cpu")),
        ValueError,
        exactly("Expected `device_type` of type `str`, got: `<class 'torch.device'>`"),
    ),
}


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_bad_arguments_raise_torchs_errors(A, case):
    make, error, pattern = ARGUMENT_ERRORS[case]
    with pytest.raises(error, match=pattern):
        make(A)


# -- custom_fwd / custom_bwd -----------------------------------------------------------------------
@pytest.mark.parametrize("region", [None, BF16, FP16], ids=["no-region", "bf16", "fp16"])
def test_custom_bwd_runs_backward_in_the_autocast_state_of_the_forward(A, region):
    seen = {}

    class MatMul(torch.autograd.Function):
        @staticmethod
        @A.custom_fwd(device_type="cpu")
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = torch.mm(a, b)
            seen["forward"] = (torch.is_autocast_enabled("cpu"), out.dtype)
            return out

        @staticmethod
        @A.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            seen["backward"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            return torch.mm(grad, b.t()), torch.mm(a.t(), grad)

    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(3, 2, requires_grad=True)
    if region is None:
        out = MatMul.apply(a, b)
    else:
        with A.autocast("cpu", region):
            out = MatMul.apply(a, b)
    out.float().sum().backward()  # outside any region: custom_bwd re-enters the forward's
    if region is None:
        assert seen == {"forward": (False, FP32), "backward": (False, BF16)}
    else:
        assert seen == {"forward": (True, region), "backward": (True, region)}
    assert a.grad.dtype == b.grad.dtype == FP32


def test_custom_fwd_cast_inputs_casts_floating_inputs_and_runs_forward_without_autocast(A):
    seen = {}

    class Scale(torch.autograd.Function):
        @staticmethod
        @A.custom_fwd(device_type="cpu", cast_inputs=FP32)
        def forward(ctx, a, b, ints, doubles, in_list, in_dict):
            tensors = (a, b, ints, doubles, in_list[0], in_dict["k"])
            seen["forward"] = {
                "enabled": torch.is_autocast_enabled("cpu"),
                "dtypes": [t.dtype for t in tensors],
                "mm": torch.mm(a, a).dtype,  # bfloat16 if autocast were on
            }
            return a * 2

        @staticmethod
        @A.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            seen["backward"] = torch.is_autocast_enabled("cpu")
            return grad * 2, None, None, None, None, None

    def args():
        a = torch.randn(2, 2, dtype=BF16, requires_grad=True)
        others = (torch.randn(2, 2), torch.ones(2, dtype=torch.long), torch.ones(2).double())
        return a, *others, [torch.ones(2, dtype=BF16)], {"k": torch.ones(2, dtype=FP16)}

    inputs = args()
    with A.autocast("cpu", BF16):
        out = Scale.apply(*inputs)
    assert seen["forward"] == {
        "enabled": False,
        "dtypes": [FP32, FP32, torch.long, torch.float64, FP32, FP32],
        "mm": FP32,
    }
    assert out.dtype == FP32
    out.sum().backward()
    assert seen["backward"] is False  # cast_inputs: the backward runs without autocast too
    assert inputs[0].grad.dtype == BF16  # autograd casts the gradient back to the input's dtype

    inputs = args()
    out = Scale.apply(*inputs)  # outside a region cast_inputs does nothing
    assert seen["forward"]["dtypes"] == [BF16, FP32, torch.long, torch.float64, BF16, FP16]
    assert seen["forward"]["mm"] == BF16
    assert out.dtype == BF16


# -- checkpointing, inputs left alone, rnn, promotion ----------------------------------------------
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing_inside_a_region_recomputes_in_the_regions_dtype(A, use_reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        with A.autocast("cpu", BF16):
            out = checkpoint(model, x, use_reentrant=use_reentrant) if checkpointed else model(x)
        assert out.dtype == BF16
        out.float().pow(2).sum().backward()  # outside the region: recomputed as in the region
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        x.grad = None
        model.zero_grad()
    for plain, recomputed in zip(*grads):
        assert recomputed.dtype == plain.dtype and torch.equal(recomputed, plain)


def test_float64_and_integer_inputs_are_left_alone(A):
    d = torch.randn(3, 3, dtype=torch.float64)
    i = torch.ones(3, 3, dtype=torch.long)
    with A.autocast("cpu", BF16):
        assert torch.mm(d, d).dtype == torch.float64
        assert torch.mm(i, i).dtype == torch.long
        assert torch.equal(torch.mm(d, d), d @ d)


def test_in_place_and_out_calls_are_not_autocast(A):
    a, b, c = torch.randn(3, 3), torch.randn(3, 3), torch.randn(3, 3)
    expected_mm, expected_addmm = torch.mm(b, c), torch.addmm(a, b, c)
    with A.autocast("cpu", BF16):
        out = torch.empty(3, 3)
        torch.mm(b, c, out=out)
        inplace = a.clone()
        inplace.addmm_(b, c)
        assert torch.mm(b, c).dtype == BF16  # the out-of-place call is autocast
    assert out.dtype == inplace.dtype == FP32
    assert torch.equal(out, expected_mm) and torch.equal(inplace, expected_addmm)


@functools.cache
def bf16_lstm_runs_under_cpu_autocast() -> bool:
    """Whether torch's CPU autocast can run a bf16 LSTM here: it calls oneDNN's bf16 LSTM, which
    AVX2-only CPUs (and ONEDNN_MAX_CPU_ISA=AVX2) lack -- "could not create a primitive
    descriptor for the LSTM forward propagation primitive". Probed with the test's own call
    under autocast: outside autocast a bf16 LSTM takes another path and runs on the same CPU,
    and MKLDNN being built says nothing about its bf16 RNN."""
    lstm = nn.LSTM(4, 4).to(BF16)
    try:
        with torch.autocast("cpu", BF16):
            lstm(torch.randn(3, 2, 4))
    except RuntimeError as e:
        if "could not create a primitive descriptor" not in str(e):
            raise
        return False
    return True


def test_a_bfloat16_lstm_takes_float32_input_only_under_autocast(A):
    if not bf16_lstm_runs_under_cpu_autocast():
        pytest.skip("this CPU's oneDNN has no bf16 LSTM primitive, which CPU autocast calls")
    lstm = nn.LSTM(4, 4).to(BF16)
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="does not match weight dtype"):
        lstm(x)
    with A.autocast("cpu", BF16):
        out, (h, c) = lstm(x)
    assert out.dtype == h.dtype == c.dtype == BF16


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_index_put_of_16_bit_tensors_runs_forward_and_backward_in_a_region(A, dtype):
    base = torch.zeros(6, dtype=dtype, requires_grad=True)
    values = torch.randn(2, dtype=dtype, requires_grad=True)
    with A.autocast("cpu", BF16):
        out = torch.index_put(base, (torch.tensor([1, 3]),), values)
    assert out.dtype == dtype
    out.float().sum().backward()
    overwritten = torch.tensor([1.0, 0, 1, 0, 1, 1], dtype=dtype)  # no gradient where replaced
    assert torch.equal(base.grad, overwritten)
    assert torch.equal(values.grad, torch.ones(2, dtype=dtype))
