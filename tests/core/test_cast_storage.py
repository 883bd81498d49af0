"""What the cast to 16 bits keeps of each parameter's fp32 value, and what it never aliases.

The fp32 value a master or a Kahan buffer starts from is the parameter's own pre-cast tensor
when nothing else shares its storage (no copy: the cast adds only the 16-bit weights), else a
copy: a ``state_dict()`` taken before ``initialize`` must not change when the masters step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core.storage import cast_storage

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16 = torch.bfloat16


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 8)


def test_a_parameter_nothing_else_holds_gives_its_own_tensor():
    model = _linear()
    before = {id(p): (p.data_ptr(), p.detach().clone()) for p in model.parameters()}
    kept: dict[int, torch.Tensor] = {}
    cast_storage(model, BF16, "none", set(before), kept)
    for key, (ptr, value) in before.items():
        assert kept[key].dtype == torch.float32
        assert kept[key].data_ptr() == ptr  # taken over, not copied
        assert torch.equal(kept[key], value)
    assert all(p.dtype == BF16 for p in model.parameters())


def test_a_parameter_shared_with_a_state_dict_is_copied():
    model = _linear()
    sd = model.state_dict()  # shares the parameters' storage
    kept: dict[int, torch.Tensor] = {}
    cast_storage(model, BF16, "none", {id(p) for p in model.parameters()}, kept)
    for name, p in model.named_parameters():
        assert kept[id(p)].data_ptr() != sd[name].data_ptr()
        assert torch.equal(kept[id(p)], sd[name])


def test_masters_never_step_a_state_dict_taken_before_initialize():
    model = _linear()
    sd = model.state_dict()
    snapshot = {k: v.clone() for k, v in sd.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = mixprec.initialize(model, opt, "O2", BF16)
    opt.backward(model(torch.randn(4, 8)).float().square().mean())
    opt.step()
    assert any(not torch.equal(m, snapshot[k]) for k, m in zip(sd, opt.master_params()))
    for k, v in sd.items():
        assert torch.equal(v, snapshot[k]), k


@pytest.mark.parametrize("hold", [False, True])
def test_kahan_buffers_start_from_the_fp32_values_either_way(hold):
    model = _linear()
    fp32 = [p.detach().clone() for p in model.parameters()]
    held = model.state_dict() if hold else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, "O3", BF16)
    for p, value in zip(model.parameters(), fp32):
        comp = opt.updater.compensation[p]
        assert torch.equal(comp, (value - p.float()).to(BF16))
    if held is not None:  # what was taken before initialize keeps its fp32 values, stepped
        opt.backward(model(torch.randn(4, 8)).float().square().mean())
        opt.step()
        assert any(not torch.equal(p.float(), v) for p, v in zip(model.parameters(), fp32))
        for (name, v), value in zip(held.items(), fp32, strict=True):
            assert v.dtype == torch.float32 and torch.equal(v, value), name
