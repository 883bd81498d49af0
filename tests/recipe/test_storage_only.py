"""Storage-only precision: 16-bit weights at rest, fp32 compute (``compute="fp32"``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Recipe
from mixprec._core import hardware as hw
from mixprec._core import widening
from tests.training_helpers import assert_bitwise, batch, train

LEAN32 = Recipe("lean", torch.bfloat16, compute="fp32")


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _init(recipe: Recipe = LEAN32) -> nn.Module:
    model = _mlp()
    return mixprec.initialize(model, torch.optim.AdamW(model.parameters()), recipe)[0]


def _widened_twin(model: nn.Module) -> nn.Module:
    twin = _mlp()
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return twin


def test_recipe_spells_and_parses_back():
    assert str(LEAN32) == "lean bf16 compute=fp32"
    assert Recipe(str(LEAN32)) == LEAN32 and not LEAN32.fp32_inside
    assert LEAN32.scaling(torch.bfloat16) is None
    assert Recipe("lean", torch.float16, compute="fp32").scaling(torch.float16) is not None


def test_masters_with_fp32_compute_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"compute='fp32'.*masters=True.*Recipe\('lean'"):
        Recipe("O2", torch.bfloat16, compute="fp32")


def test_dtypes_at_every_boundary():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = LEAN32.replace(gradients="held")
    model, opt = mixprec.initialize(model, opt, recipe)
    seen = []
    model[0].register_forward_pre_hook(lambda m, i: seen.append((m.weight.dtype, i[0].dtype)))
    x, y = batch(n=8)
    out = model(x)
    assert seen == [(torch.float32, torch.float32)]  # the GEMM's operands
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # at rest
    assert isinstance(model[0]._parameters["weight"], nn.Parameter)
    (out - y).pow(2).mean().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_forward_and_gradients_equal_fp32_on_the_widened_weights():
    model = _init(LEAN32.replace(gradients="held"))  # "auto" would code them in backward
    twin = _widened_twin(model)
    x, y = batch(n=8)
    out, ref = model(x), twin(x)
    assert_bitwise(out, ref)
    (out - y).pow(2).mean().backward()
    (ref - y).pow(2).mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_bitwise(p.grad, q.grad.to(torch.bfloat16))


def test_no_fp32_weight_copy_outlives_its_module():
    model = _init()
    out = model(batch(n=8)[0])  # the graph is alive, its weights saved as the parameters
    assert len(widening._widened) == 0
    out.sum().backward()


def test_a_weight_changed_before_backward_is_refused():
    model = _init()
    out = model(batch(n=8)[0])
    with torch.no_grad():
        model[3].weight.add_(1)  # its GEMM saved it (its input needs a gradient)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_lean_trains_and_resumes_bit_for_bit():
    def fresh():
        model = _mlp()
        return mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), LEAN32)

    model, opt = fresh()
    losses = train(model, opt, 6)
    assert losses[-1] < 0.7 * losses[0]
    model_sd, opt_sd = copy.deepcopy((model.state_dict(), opt.state_dict()))
    after = train(model, opt, 4)
    model2, opt2 = fresh()
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    assert train(model2, opt2, 4) == after
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise(p, q)


def test_slow_host_warning_names_storage_only(monkeypatch):
    slow = hw.HardwareReport("cpu", "fake AVX2 CPU", ("avx2",), hw._cpu_support(frozenset()))
    monkeypatch.setattr(hw, "_report", lambda device: slow)
    hw._reset_warnings()
    # the bytes per parameter are the recipe table's, not a sentence's own
    table = LEAN32.loop_bytes()  # 8-bit codes and their block scales: 4.03 and 5.05
    said = (
        f"{table['plain']:.1f} B/param of training state with AdamW ({table['clip']:.1f} where "
        "the loop clips or accumulates)"
    )
    assert said.startswith("4.0 B/param") and "(5.0 where" in said
    with pytest.warns(hw.MixprecPerformanceWarning, match=r"compute='fp32'") as caught:
        _init(Recipe("lean", torch.bfloat16))
    assert f"{said} against fp32's 16.0" in str(caught[0].message)
    assert "compute='fp32'" in str(slow) and said in str(slow)
    assert "6.0 B/param" in hw.storage_only(torch.float16)  # fp16 holds its scaled gradients
    hw._reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hw.MixprecPerformanceWarning)
        _init()  # fp32 compute: nothing slow to say
    hw._reset_warnings()


def test_fast_host_report_unchanged():
    fast = hw.HardwareReport("cpu", "fake", ("avx512_bf16",), hw._cpu_support({"avx512_bf16"}))
    assert "storage-only" not in str(fast)
