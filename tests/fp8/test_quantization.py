"""FP8 storage primitives: scales, round trips, and overflow that is never hidden."""

from __future__ import annotations

import pytest
import torch

from mixprec.fp8 import quantization
from mixprec.fp8.quantization import E4M3, E5M2, dequantize, quantize, sqnr


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("axis", [None, -1])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_trip_is_within_the_format_precision(axis, dtype):
    x = _x(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)  # rows of very different ranges
    q = quantization.quantize(x, dtype, axis=axis)
    assert q.data.dtype == dtype and q.scale.dtype == torch.float32
    assert q.scale.shape == ((32, 1) if axis == -1 else ())
    back = quantization.dequantize(q)
    # per row the largest value maps exactly onto the format's max
    top = torch.finfo(dtype).max
    assert torch.equal(
        q.data.float().abs().amax(1 if axis == -1 else None).max(), torch.tensor(top)
    )
    if axis == -1:  # rows keep their own range: ~2^-4 (e4m3) / 2^-3 (e5m2) relative error
        assert quantization.sqnr(x, back) > (28 if dtype == E4M3 else 22)
    else:  # one scale for six decades: the small rows flush to zero
        assert quantization.sqnr(x, back) > 20
        assert back[0].abs().max() < x[0].abs().max()


def test_rowwise_beats_tensorwise_on_uneven_rows():
    x = _x(16, 64) * torch.logspace(-4, 2, 16).unsqueeze(1)
    row = sqnr(x[:4], dequantize(quantize(x, axis=-1))[:4])
    tensor = sqnr(x[:4], dequantize(quantize(x, axis=None))[:4])
    assert row > 25 > tensor


def test_power_of_2_scales_are_exact_powers_and_keep_the_range():
    x = _x(8, 48)
    q = quantization.quantize(x, E4M3, axis=-1, power_of_2=True)
    assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))
    assert (q.data.float().abs().amax(1) <= 448).all()
    assert quantization.sqnr(x, quantization.dequantize(q)) > 25


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_non_finite_value_poisons_its_slice_instead_of_saturating(bad, dtype):
    x = _x(4, 32)
    x[2, 5] = bad
    back = quantization.dequantize(quantization.quantize(x, dtype, axis=-1))
    assert back[2].isnan().all()  # not 448 or 57344: the overflow stays visible
    assert torch.isfinite(back[[0, 1, 3]]).all()
    whole = quantization.dequantize(quantization.quantize(x, dtype, axis=None))
    assert whole.isnan().all()


def test_zero_slices_and_16bit_inputs():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1] = torch.linspace(-2, 2, 16)
    q = quantization.quantize(x, axis=-1)
    back = quantization.dequantize(q, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back[0], x[0])
    assert quantization.sqnr(x[1], back[1]) > 25


def test_a_given_scale_is_used_as_is():
    x = _x(4, 16)
    q = quantization.quantize(x, E4M3, axis=None, scale=torch.tensor(2.0))
    assert torch.equal(q.scale, torch.tensor(2.0))
    assert torch.equal(q.data.float(), (x * 2).to(E4M3).float())


def test_bad_input_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2.*torch.bfloat16"):
        quantization.quantize(_x(2, 2), torch.bfloat16)
    with pytest.raises(TypeError, match="floating tensor.*torch.int64"):
        quantization.quantize(torch.ones(2, 2, dtype=torch.long))


def test_sqnr():
    x = _x(100)
    assert quantization.sqnr(x, x) == float("inf")
    assert quantization.sqnr(x, x * 1.1) == pytest.approx(20.0, abs=1e-5)


@pytest.mark.parametrize("src", [E4M3, E5M2])
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_widening_equals_torchs_cast_for_every_finite_code(src, dst):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(src)
    want = codes.to(dst)
    got = quantization._widen_bits(codes, dst)
    finite = torch.isfinite(want)
    assert finite.sum() >= 248  # all but the NaN/inf codes, subnormals and -0.0 included
    assert torch.equal(
        got[finite].view(torch.int16 if dst != torch.float32 else torch.int32),
        want[finite].view(torch.int16 if dst != torch.float32 else torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_power_of_2_path_is_bitwise_the_float32_path(dtype, fp8, monkeypatch):
    x = (_x(64, 48) * torch.logspace(-6, 2, 64).unsqueeze(1)).to(dtype)
    fast = quantization.quantize(x, fp8, axis=-1, power_of_2=True)
    assert fast.power_of_2
    slow = quantize(x, fp8, axis=-1, scale=fast.scale)  # same scale, float32 arithmetic
    assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8))
    exact = (slow.data.float() / slow.scale).to(dtype)
    bits = quantization.dequantize(fast, dtype)  # on a CPU: the bit widening
    monkeypatch.setattr(quantization, "_WIDEN", {})  # elsewhere: torch's cast
    cast = quantization.dequantize(fast, dtype)
    assert bits.dtype == cast.dtype == dtype
    assert torch.equal(bits, exact) and torch.equal(cast, exact)


def _amax_values() -> torch.Tensor:
    """Positive finite float32 values from 2^16 random bit patterns (every binade from 1e-12
    up), plus edges: the clamp, a subnormal, huge values, powers of two, the formats' maxima."""
    bits = torch.randint(0, 0x7F800000, (1 << 16,), generator=torch.Generator().manual_seed(0))
    spread = bits.to(torch.int32).view(torch.float32)
    edges = torch.tensor([1e-12, 1e-40, 1.0, 2.0**-20, 3.0, 448.0, 57344.0, 3.4e38, 1e-6, 0.1])
    return torch.cat([spread[spread >= 1e-12], edges.clamp(min=1e-12)])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_is_the_correctly_rounded_quotient_of_the_formats_max_and_amax(dtype):
    """``fp8_max / amax`` rounded once to float32, as torchao computes it, checked against an
    independent reference: Python's float64 division of each value, rounded to float32."""
    amax = _amax_values()
    top = torch.finfo(dtype).max
    ref = torch.tensor([top / a for a in amax.double().tolist()], dtype=torch.float64).float()
    assert ref.isfinite().all() and amax.numel() > 30000
    assert torch.equal(quantization.scale_for(amax, dtype), ref)
    # the product of the reciprocal (what `top / tensor` computes in torch) is off by one ulp
    # for many of them: the reference tells the two apart
    assert (amax.reciprocal() * top != ref).float().mean() > 0.1
    # zero, inf and NaN amax: the clamp's huge scale, 0 and NaN (the slice comes back NaN)
    odd = quantization.scale_for(torch.tensor([0.0, float("inf"), float("nan")]), dtype)
    assert odd[0] == torch.tensor(top / 1e-12, dtype=torch.float64).float() and odd[1] == 0
    assert odd[2].isnan()


def _quotients(amax: torch.Tensor) -> torch.Tensor:
    """448 / each value in Python's float64, rounded to float32, in ``amax``'s shape."""
    flat = [448.0 / a for a in amax.double().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).float().reshape(amax.shape)


def test_quantize_tensorwise_rowwise_and_chunked_use_that_scale(monkeypatch):
    x = _x(64, 96) * torch.logspace(-6, 6, 64).unsqueeze(1)
    assert torch.equal(quantization.quantize(x, E4M3, axis=None).scale, _quotients(x.abs().max()))
    rows = _quotients(x.abs().amax(1, keepdim=True))
    assert torch.equal(quantization.quantize(x, E4M3, axis=-1).scale, rows)
    monkeypatch.setattr(quantization, "_CHUNK", 96 * 8)  # 8-row slices
    b = x.bfloat16()
    chunked = quantization.quantize_chunked(b, E4M3, axis=-1)
    assert torch.equal(chunked.scale, _quotients(b.float().abs().amax(1, keepdim=True)))
    whole = quantization.quantize_chunked(b, E4M3, axis=None)
    assert torch.equal(whole.scale, _quotients(b.float().abs().max()))


def test_power_of_2_scale_never_overshoots_when_top_over_amax_rounds_up():
    # found by search: for these, log2 of the float32 quotient top / amax (a few ulps below a
    # power of two) rounds up onto the power, and floor() keeps it
    amax = torch.tensor([0.0034179703798145056, 0.1093750149011612, 5.3405768994707614e-05])
    top = torch.finfo(E4M3).max
    naive = torch.exp2(torch.floor(torch.log2(torch.full_like(amax, top) / amax)))
    assert (amax * naive > top).all()
    scale = quantization.scale_for(amax, E4M3, power_of_2=True)
    assert torch.equal(scale, naive / 2) and (amax * scale <= top).all()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_power_of_2_path_keeps_a_poisoned_row_non_finite(bad):
    x = _x(4, 32).to(torch.bfloat16)
    x[1, 3] = bad
    back = dequantize(quantize(x, axis=-1, power_of_2=True), torch.bfloat16)
    assert not torch.isfinite(back[1]).any()
    assert torch.isfinite(back[[0, 2, 3]]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_amax_by_magnitude_bits_is_abs_amax_with_signs_zeros_inf_and_nan(dtype):
    x = (_x(6, 40) * 300).to(dtype)
    x[0, 0], x[1] = -0.0, 0.0  # an all-zero row, negative zero
    x[2, 5], x[3, 7], x[4, 9] = float("-inf"), float("nan"), -float(torch.finfo(dtype).max)
    for axis in (None, -1, 0):
        for t in (x, x.t()):  # contiguous and not
            got = quantization.amax(t[[0, 1, 4, 5]] if axis is None else t, axis)
            want = t[[0, 1, 4, 5]] if axis is None else t
            want = (want.abs().amax() if axis is None else want.abs().amax(axis, True)).float()
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert quantization.amax(x, None).isnan()  # NaN anywhere wins over inf


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("power_of_2", [True, False])
def test_dequantize_into_equals_dequantize_across_slices(out_dtype, power_of_2, monkeypatch):
    monkeypatch.setattr(quantization, "_CHUNK", 256)  # 8-row slices of a 37-row tensor
    x = (_x(37, 32) * torch.logspace(-4, 4, 37).unsqueeze(1)).to(torch.bfloat16)
    x[5, 2] = float("inf")  # a poisoned row stays non-finite
    for axis in (-1, None):
        q = quantization.quantize_chunked(x, E4M3, axis, power_of_2)
        want = quantization.dequantize(q, out_dtype)
        out = torch.full(x.shape, 7.0, dtype=out_dtype)
        assert quantization.dequantize_into(q, out) is out
        assert torch.equal(out.isnan(), want.isnan())
        assert torch.equal(out.nan_to_num(), want.nan_to_num())
        assert not torch.isfinite(out[5]).any()
    with pytest.raises(ValueError, match=r"out has shape \(37, 31\); the data has \(37, 32\)"):
        quantization.dequantize_into(q, torch.empty(37, 31))
