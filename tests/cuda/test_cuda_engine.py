"""The eager engine on a GPU: dtypes, torch.autocast left as torch has it, compile,
checkpointing (backward runs on the device's autograd thread there) and loss-scale tensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._core import traced
from tests.core.test_regions import _Block, _Net

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_region_dtypes_on_cuda(dtype):
    x = torch.randn(4, 8, device="cuda")
    lin = nn.Linear(8, 8).cuda()
    with mixprec.autocast(dtype):
        y = lin(x)
        assert y.dtype == dtype
        assert torch.softmax(y, -1).dtype == F32
        assert F.layer_norm(y, (8,)).dtype == F32
        assert y.sum().dtype == F32 and y.mean().dtype == F32  # mean: torch keeps it 16-bit
        assert torch.cat([y, y.to(BF16 if dtype == F16 else F16)]).dtype == F32
        p = torch.sigmoid(y)
        bce = F.binary_cross_entropy(p, torch.rand_like(p))  # torch.autocast refuses this
        assert bce.dtype == F32 and torch.isfinite(bce)


def test_plain_torch_autocast_on_cuda_is_untouched():
    x = torch.randn(4, 8, device="cuda")
    with mixprec.autocast(BF16):  # registers mixprec's kernels
        x.sum()
    with torch.autocast("cuda", BF16):
        y = torch.mm(x, x.t())
        assert y.dtype == BF16
        assert F.layer_norm(y, (4,)).dtype == F32  # torch's CUDA rule
        assert y.mean().dtype == BF16  # not in torch's CUDA list
        with pytest.raises(RuntimeError):
            F.binary_cross_entropy(torch.sigmoid(y), torch.rand_like(y))


def test_fp32_inside_keeps_norms_16bit_at_o2():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = mixprec.initialize(model, opt, "O2", BF16)
    seen = {}
    model[1].register_forward_hook(lambda m, a, out: seen.update(ln=out.dtype))
    out = model(torch.randn(3, 8, device="cuda"))
    assert seen["ln"] == BF16 and out.dtype == F32 and model[1].weight.dtype == F32


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_checkpointing_bitwise_on_cuda(level, reentrant):
    torch.manual_seed(0)
    base = _Net().cuda()
    x = torch.randn(4, 8, device="cuda")
    grads = []
    for ckpt in (None, reentrant):
        model = copy.deepcopy(base)
        model.ckpt = ckpt
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, level, BF16)
        opt.backward(model(x).float().pow(2).mean())
        grads.append([p.grad for group in opt.param_groups for p in group["params"]])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_compile_on_cuda(level):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, level, BF16)
    x = torch.randn(4, 8, device="cuda")
    breaks = torch._dynamo.explain(model)(x).graph_break_count
    assert breaks == 0 or not traced.dynamo_traces_autocast_setters()  # torch < 2.13 breaks
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend="aot_eager")(x), model(x))
    torch._dynamo.reset()
    fast = torch.compile(model)(x)  # inductor fuses casts: close, not bitwise
    torch.testing.assert_close(fast, model(x), rtol=2e-2, atol=2e-2)


def test_loss_scale_change_does_not_recompile_on_cuda():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    block = _Block(8).cuda()
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    block, opt = mixprec.initialize(block, opt, "O2", F16)
    scaler = opt.slot(0).scaler
    counter = CompileCounter()
    fn = torch.compile(lambda x: scaler.scale_loss(block(x).float().pow(2).mean()), backend=counter)
    x = torch.randn(4, 8, device="cuda")
    compiled = []
    for _ in range(3):
        fn(x)
        compiled.append(counter.frame_count)
        scaler.update(found_inf=True)
    if traced.dynamo_traces_autocast_setters():  # torch >= 2.13: one graph, compiled once
        assert compiled == [compiled[0]] * 3
    else:  # older dynamo breaks at the boundary; seen on 2.11: one late frame, then stable
        assert compiled[2] == compiled[1]
