"""The FP8 linear: its three GEMMs through torch._scaled_mm, their numbers against the bf16
layer (torchao's SQNR thresholds), what it saves for backward, CUDA's rules held on a CPU, and
compiled code equal to eager code bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.fp8 import quantization
from mixprec.fp8.config import RECIPES
from mixprec.fp8.gemm import check_gemm, scaled_mm
from mixprec.fp8.linear import fp8_linear
from mixprec.fp8.quantization import E4M3, E5M2, dequantize, quantize, quantize_chunked, sqnr
from tests.training_helpers import linear_run

RECIPE_NAMES = sorted(RECIPES)

pytestmark = pytest.mark.usefixtures("one_thread")


class CountGemms(TorchDispatchMode):
    """Counts the aten GEMMs that ran, by name, with their operand dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_scaled_mm", "mm", "addmm", "bmm", "matmul"):
            self.calls.append((name, args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _layer(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    dy = torch.randn(m, n, generator=g).bfloat16()
    return x, w, b, dy


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), [(16, 32, 48), (3 * 17, 64, 32), (256, 128, 256)])
def test_fp8_linear_matches_the_bf16_layer_within_torchaos_sqnr(recipe, m, k, n):
    x, w, b, dy = _layer(m, k, n)
    r = RECIPES[recipe]
    ref = linear_run(F.linear, x, w, b, dy)
    out = linear_run(lambda x, w, b: fp8_linear(x, w, b, r, torch.bfloat16), x, w, b, dy)
    y, dx, dw, db = out
    assert [t.dtype for t in out] == [torch.bfloat16] * 4
    assert sqnr(ref[0], y) >= 18 and sqnr(ref[2], dw) >= 17  # torchao's Float8Linear test
    assert sqnr(ref[1], dx) >= 17
    assert torch.equal(db, ref[3])  # the bias gradient stays 16-bit: dy summed
    # each cast alone keeps >= 25 dB (torchao's axiswise-cast threshold)
    axis = -1 if r.rowwise else None
    for t, dt in ((x, E4M3), (w, E4M3), (dy, r.grad_dtype)):
        q = quantize(t, dt, axis, r.power_of_2)
        assert sqnr(t, dequantize(q)) >= 25


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_all_three_gemms_run_through_scaled_mm_with_the_recipes_formats(recipe):
    x, w, b, dy = _layer(32, 64, 48)
    r = RECIPES[recipe]
    with CountGemms() as c:
        linear_run(lambda x, w, b: fp8_linear(x, w, b, r, torch.bfloat16), x, w, b, dy)
    assert [name for name, *_ in c.calls] == ["_scaled_mm"] * 3
    fwd, dx, dw = c.calls
    assert fwd[1:] == (E4M3, E4M3)
    assert r.grad_dtype in dx[1:] and E4M3 in dx[1:]
    assert r.grad_dtype in dw[1:] and E4M3 in dw[1:]
    if recipe == "tensorwise":
        assert dx[1] == E5M2  # e5m2 gradients, never e5m2 x e5m2


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_backward_keeps_the_fp8_copy_of_the_input_not_the_16_bit_one(recipe):
    x, w, b, _ = _layer(64, 64, 32)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_linear(x, w, b, RECIPES[recipe], torch.bfloat16)
    acts = [t for t in saved if t is not w]
    assert [t.dtype for t in acts] == [E4M3, torch.float64]  # data and its exact scale
    assert acts[0].shape == x.shape and acts[0].element_size() == 1
    expect = (1, 64) if recipe == "rowwise" else ()  # rowwise: per column, for dw over M
    assert tuple(acts[1].shape) == expect
    assert not any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in saved)


def test_nothing_is_saved_for_a_frozen_weight():
    x, w, _, _ = _layer(32, 32, 32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8_linear(x.requires_grad_(), w, None, RECIPES["tensorwise"], torch.bfloat16)
    y.sum().backward()
    assert saved == [w] and x.grad is not None and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_an_inf_in_the_input_comes_out_nan_instead_of_saturating(recipe):
    x, w, b, _ = _layer(16, 32, 16)
    x[3, 5] = float("inf")
    y = fp8_linear(x, w, b, RECIPES[recipe], torch.bfloat16)
    # a saturating cast would have turned the inf into 448 / scale: a finite, wrong output
    bad = ~torch.isfinite(y)
    assert bad.any()
    if recipe == "rowwise":  # only the row holding the inf
        assert bad[3].all() and not bad[torch.arange(16) != 3].any()


def test_leading_dims_odd_token_counts_and_float32_inputs():
    r = RECIPES["tensorwise"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 32, generator=g).requires_grad_()  # 21 tokens: dw pads M to 32
    w = torch.randn(16, 32, generator=g).requires_grad_()
    y = fp8_linear(x, w, None, r, torch.bfloat16)
    assert y.shape == (3, 7, 16) and y.dtype == torch.bfloat16
    dy = torch.randn(3, 7, 16, generator=g)
    y.backward(dy.bfloat16())
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert sqnr(dy.reshape(21, 16).t() @ x.detach().reshape(21, 32), w.grad) > 20
    assert sqnr(dy @ w.detach(), x.grad) > 20
    one = fp8_linear(torch.randn(32), w.detach(), None, r, torch.float32)  # a 1-D input
    assert one.shape == (16,) and one.dtype == torch.float32


def test_check_gemm_refuses_what_cuda_refuses():
    a = torch.zeros(32, 32, dtype=E4M3)
    one = torch.ones(())
    check_gemm(a, a.t(), one, one, torch.bfloat16)  # row-major x column-major, K, N % 16
    with pytest.raises(ValueError, match="multiples of 16"):
        check_gemm(torch.zeros(32, 24, dtype=E4M3), torch.zeros(16, 24, dtype=E4M3).t(), one, one,
                   torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="column-major"):
        check_gemm(a, a.contiguous(), one, one, torch.bfloat16)
    with pytest.raises(ValueError, match="e5m2"):
        e5 = torch.zeros(32, 32, dtype=E5M2)
        check_gemm(e5, e5.t(), one, one, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        check_gemm(a, a.t(), torch.ones(32, 1), torch.ones(1, 32), torch.float32)
    with pytest.raises(ValueError, match="per row"):
        check_gemm(a, a.t(), torch.ones(32, 1), one, torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        scaled_mm(a, a.t(), one, one, torch.float32, bias=torch.zeros(32))
    with pytest.raises(ValueError, match="must be FP8"):
        check_gemm(torch.zeros(32, 32), a.t(), one, one, torch.bfloat16)


def test_quantize_chunked_gives_quantizes_scales_and_data(monkeypatch):
    monkeypatch.setattr(quantization, "_CHUNK", 1000)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 48, generator=g) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=g))
    x[3, 5] = float("inf")
    for dt in (torch.bfloat16, torch.float32):
        xt = x.to(dt)
        before = xt.clone()
        for fmt in (E4M3, E5M2):
            for axis in (None, -1, 0):
                for p2 in (False, True):
                    a, b = quantize(xt, fmt, axis, p2), quantize_chunked(xt, fmt, axis, p2)
                    assert torch.equal(a.scale.nan_to_num(-1), b.scale.nan_to_num(-1))
                    same = a.data.float().nan_to_num(7) == b.data.float().nan_to_num(7)
                    assert same.all()  # a NaN's sign bit aside
        assert torch.equal(xt.nan_to_num(0), before.nan_to_num(0))  # the input is not touched


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compiled_fp8_linear_equals_eager_bit_for_bit(recipe):
    r = RECIPES[recipe]
    x, w, b, dy = _layer(40, 64, 48)
    x = x.reshape(4, 10, 64)
    dy = dy.reshape(4, 10, 48)

    def fn(x, w, b):
        return fp8_linear(x, w, b, r, torch.bfloat16)

    eager = linear_run(fn, x, w, b, dy)
    torch._dynamo.reset()
    compiled = linear_run(torch.compile(fn, fullgraph=True), x, w, b, dy)
    for e, c in zip(eager, compiled):
        assert e.dtype == c.dtype and torch.equal(e, c)
