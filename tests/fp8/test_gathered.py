"""GatheredFP8Weight (the FSDP2 FP8 all-gather's weight) in one process, and the config option
that asks for it. The 2-rank runs are in tests/distributed/test_fp8_gather.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import FP8Config, Recipe
from mixprec.fp8 import RECIPES, fp8_linear
from mixprec.fp8.gathered import GatheredFP8Weight
from mixprec.fp8.quantization import E4M3, quantize

BF16 = torch.bfloat16


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(32, 48, generator=g) * 0.05).to(BF16)


def _gathered(w: torch.Tensor) -> GatheredFP8Weight:
    q = quantize(w, E4M3, None)  # what the ranks gather: the whole weight's scale
    return GatheredFP8Weight(q.data, q.scale, w.dtype)


def test_the_fp8_linear_on_a_gathered_weight_equals_it_on_the_16_bit_weight_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 48, generator=g).to(BF16)
    dy = torch.randn(20, 32, generator=g).to(BF16)
    bias = torch.randn(32, generator=g).to(BF16)
    w = _weight()
    runs = []
    for weight in (nn.Parameter(w.clone()), nn.Parameter(_gathered(w))):
        xi = x.clone().requires_grad_()
        y = fp8_linear(xi, weight, bias, RECIPES["tensorwise"])
        y.backward(dy)
        runs.append((y, xi.grad, weight.grad))
    assert type(runs[1][2]) is torch.Tensor and runs[1][2].dtype == BF16  # a plain 16-bit grad
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_gathered_weight_is_refused_by_the_rowwise_recipe():
    x = torch.randn(4, 48).to(BF16)
    with pytest.raises(ValueError, match="rowwise recipe scales per row"):
        fp8_linear(x, _gathered(_weight()), None, RECIPES["rowwise"])


def test_views_stay_fp8_other_ops_see_the_dequantized_values_and_writes_are_refused():
    w = _weight()
    gw = _gathered(w)
    view = torch.as_strided(gw, (16, 48), (48, 1))
    assert isinstance(gw.detach(), GatheredFP8Weight) and isinstance(view, GatheredFP8Weight)
    assert view.data8.data_ptr() == gw.data8.data_ptr() and view.scale is gw.scale
    values = gw.dequantize()
    assert type(values) is torch.Tensor and values.dtype == BF16
    assert torch.equal(gw + 0, values) and torch.equal(gw.abs().amax(), values.abs().amax())
    assert (values.float() - w.float()).abs().max() <= 0.0625 * w.float().abs().max()
    assert torch.zeros_like(gw).dtype == BF16
    with pytest.raises(RuntimeError, match="cannot be written to"):
        gw.mul_(2)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        GatheredFP8Weight(w, torch.ones(()), BF16)


def test_the_all_gather_option_of_the_fp8_config():
    assert FP8Config().gathers_fp8 and FP8Config("tensorwise", all_gather="fp8").gathers_fp8
    assert not FP8Config("rowwise").gathers_fp8
    assert not FP8Config("tensorwise", all_gather="16-bit").gathers_fp8
    with pytest.raises(ValueError, match="rowwise scales differ"):
        FP8Config("rowwise", all_gather="fp8")
    with pytest.raises(ValueError, match="all_gather='bf16'"):
        FP8Config(all_gather="bf16")
    recipe = Recipe("fp8-tensorwise", BF16, fp8=FP8Config(all_gather="16-bit"))
    assert str(recipe) == "fp8-tensorwise bf16 fp8=tensorwise(all_gather=16-bit)"
    assert Recipe(str(recipe)) == recipe
    assert Recipe("fp8-tensorwise", BF16).fp8.all_gather == "auto"
