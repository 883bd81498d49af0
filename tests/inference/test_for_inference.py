"""mixprec.for_inference and int8 mixing: storage dtypes, weight sources, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._core import engine
from mixprec.inference.prepare import inference_info
from mixprec.inference.quantize import Int8WeightOnly, cosine_error


class Net(nn.Module):
    """Linear, BatchNorm, LayerNorm, and a temperature consumed by exp (an fp32-rule op)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)
        self.temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.relu(self.bn(self.fc1(x))))
        return self.fc2(h) * torch.exp(self.temp)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    net.train()
    with torch.no_grad():  # non-trivial BatchNorm statistics
        for _ in range(3):
            net(torch.randn(64, 8) * 2 + 1)
    return net.eval()


X = torch.randn(16, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_storage_follows_table_and_outputs_close(dtype: torch.dtype) -> None:
    net = _net()
    fast = mixprec.for_inference(net, dtype, X)
    assert fast.fc1.weight.dtype == fast.fc2.bias.dtype == dtype
    assert fast.bn.running_mean.dtype == fast.bn.weight.dtype == torch.float32
    assert fast.ln.weight.dtype == torch.float32
    assert fast.temp.dtype == torch.float32  # found by the trace: consumed by exp
    info = inference_info(fast)
    assert "exp" in info.fp32_reasons["temp"] and "BatchNorm" in info.fp32_reasons["bn.running_var"]
    assert not fast.training and not any(p.requires_grad for p in fast.parameters())
    with torch.no_grad():
        ref, out = net(X), fast(X)
    assert out.dtype == torch.float32
    assert cosine_error(out, ref) < 1e-3
    assert all(p.dtype == torch.float32 for p in net.parameters())  # the original is untouched


def test_without_example_inputs_module_rule_only() -> None:
    fast = mixprec.for_inference(_net(), "mixed_bfloat16")
    assert fast.temp.dtype == torch.bfloat16 and fast.bn.running_mean.dtype == torch.float32


def test_from_initialized_model_uses_masters_and_from_checkpoint() -> None:
    net = _net()
    model, opt = mixprec.initialize(
        net, torch.optim.SGD(net.parameters(), lr=0.1), "O2", torch.bfloat16
    )
    model.train()
    loss = model(X).float().pow(2).mean()
    opt.backward(loss)
    opt.step()
    state = mixprec.fp32_state_dict(model, opt)
    a = mixprec.for_inference(model, torch.float32, optimizer=opt)  # exact fp32 masters
    assert torch.equal(a.fc1.weight, state["fc1.weight"])
    assert not engine.has_boundary(a) and engine.has_boundary(model)  # stripped on the copy
    b = mixprec.for_inference(_net(), torch.float16, checkpoint=state)
    assert torch.equal(b.fc1.weight, state["fc1.weight"].half())
    assert torch.equal(b.bn.running_var, state["bn.running_var"])
    with pytest.raises(ValueError, match="does not fit"):
        mixprec.for_inference(nn.Linear(3, 3), checkpoint=state)
    with pytest.raises(TypeError, match="nn.Module.*checkpoint="):
        mixprec.for_inference(state)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        mixprec.for_inference(net, bogus=1)


def test_keep_fp32_by_name_and_bad_name() -> None:
    fast = mixprec.for_inference(_net(), torch.bfloat16, keep_fp32=["fc2"])
    assert fast.fc2.weight.dtype == torch.float32 and fast.fc1.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not have"):
        mixprec.for_inference(_net(), torch.bfloat16, keep_fp32=["nope"])


def test_int8_auto_selection_respects_tolerance() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    ).eval()
    x = torch.randn(64, 64)
    with torch.no_grad():
        ref = net(x)
    loose = mixprec.for_inference(net, torch.bfloat16, x, int8="weight_only", int8_tolerance=1e-2)
    assert set(inference_info(loose).int8) == {"0", "2", "4"}
    assert all(isinstance(loose.get_submodule(n), Int8WeightOnly) for n in ("0", "2", "4"))
    assert loose[0].weight_int8.dtype == torch.int8
    tight = mixprec.for_inference(net, torch.bfloat16, x, int8="weight_only", int8_tolerance=1e-9)
    assert inference_info(tight).int8 == {}
    for model in (loose, tight):
        with torch.no_grad():
            assert cosine_error(model(x), ref) <= (1e-2 if model is loose else 1e-3)
    dyn = mixprec.for_inference(net, torch.bfloat16, x, int8="dynamic", int8_modules=["2"])
    assert "dynamic" in type(dyn[2]).__module__ and dyn[0].weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert cosine_error(dyn(x), ref) < 1e-2
    with pytest.raises(ValueError, match="candidates are"):
        mixprec.for_inference(net, torch.bfloat16, x, int8="dynamic", int8_modules=["1"])
    with pytest.raises(ValueError, match="needs example_inputs"):
        mixprec.for_inference(net, torch.bfloat16, int8="weight_only")
