"""FP8 storage primitives: scales, round trips, and overflow that is never hidden."""

from __future__ import annotations

import pytest
import torch

from mixprec.core import float8
from mixprec.core.float8 import E4M3, E5M2


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("axis", [None, -1])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_trip_is_within_the_format_precision(axis, dtype):
    x = _x(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)  # rows of very different ranges
    q = float8.quantize(x, dtype, axis=axis)
    assert q.data.dtype == dtype and q.scale.dtype == torch.float32
    assert q.scale.shape == ((32, 1) if axis == -1 else ())
    back = float8.dequantize(q)
    # per row the largest value maps exactly onto the format's max
    top = torch.finfo(dtype).max
    assert torch.equal(
        q.data.float().abs().amax(1 if axis == -1 else None).max(), torch.tensor(top)
    )
    if axis == -1:  # rows keep their own range: ~2^-4 (e4m3) / 2^-3 (e5m2) relative error
        assert float8.sqnr(x, back) > (28 if dtype == E4M3 else 22)
    else:  # one scale for six decades: the small rows flush to zero
        assert float8.sqnr(x, back) > 20
        assert back[0].abs().max() < x[0].abs().max()


def test_rowwise_beats_tensorwise_on_uneven_rows():
    x = _x(16, 64) * torch.logspace(-4, 2, 16).unsqueeze(1)
    row = float8.sqnr(x[:4], float8.dequantize(float8.quantize(x, axis=-1))[:4])
    tensor = float8.sqnr(x[:4], float8.dequantize(float8.quantize(x, axis=None))[:4])
    assert row > 25 > tensor


def test_power_of_2_scales_are_exact_powers_and_keep_the_range():
    x = _x(8, 48)
    q = float8.quantize(x, E4M3, axis=-1, power_of_2=True)
    assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))
    assert (q.data.float().abs().amax(1) <= 448).all()
    assert float8.sqnr(x, float8.dequantize(q)) > 25


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_non_finite_value_poisons_its_slice_instead_of_saturating(bad, dtype):
    x = _x(4, 32)
    x[2, 5] = bad
    back = float8.dequantize(float8.quantize(x, dtype, axis=-1))
    assert back[2].isnan().all()  # not 448 or 57344: the overflow stays visible
    assert torch.isfinite(back[[0, 1, 3]]).all()
    whole = float8.dequantize(float8.quantize(x, dtype, axis=None))
    assert whole.isnan().all()


def test_zero_slices_and_16bit_inputs():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1] = torch.linspace(-2, 2, 16)
    q = float8.quantize(x, axis=-1)
    back = float8.dequantize(q, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back[0], x[0])
    assert float8.sqnr(x[1], back[1]) > 25


def test_a_given_scale_is_used_as_is():
    x = _x(4, 16)
    q = float8.quantize(x, E4M3, axis=None, scale=torch.tensor(2.0))
    assert torch.equal(q.scale, torch.tensor(2.0))
    assert torch.equal(q.data.float(), (x * 2).to(E4M3).float())


def test_bad_input_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2.*torch.bfloat16"):
        float8.quantize(_x(2, 2), torch.bfloat16)
    with pytest.raises(TypeError, match="floating tensor.*torch.int64"):
        float8.quantize(torch.ones(2, 2, dtype=torch.long))


def test_sqnr():
    x = _x(100)
    assert float8.sqnr(x, x) == float("inf")
    assert float8.sqnr(x, x * 1.1) == pytest.approx(20.0, abs=1e-5)
