"""Training on a GPU: fp16 loss scaling on the fused unscale kernel, bf16, overflow skips that
leave every byte unchanged, one host sync per step, fused optimizers behind fp32 masters and
bit-exact resume."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn
from training_helpers import assert_bitwise, assert_tree_bitwise, mse, poisoned

import mixprec
from mixprec._core import loss_scale

BF16, FP16 = torch.bfloat16, torch.float16
pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()


def _data(n: int = 40, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, 16, 32, device="cuda", generator=g)
    w = torch.randn(32, 8, device="cuda", generator=g)
    return [(x[i], x[i] @ w / 6) for i in range(n)]


def _build(level, dtype, fused=False, **kw):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4, fused=fused)
    kw.setdefault("loss_scale", "dynamic" if dtype == FP16 else None)
    return mixprec.initialize(model, opt, mixprec.Recipe(level, dtype, **kw))


def _train(model, opt, data, poison_at=()):
    losses, skipped = [], []
    for t, (x, y) in enumerate(data):
        target = next(model.parameters()) if t in poison_at else None
        with poisoned(target):
            loss = mse(model, x, y)
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.step_skipped)
    return losses, skipped


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp16_trains_with_dynamic_scaling_on_the_fused_kernel(level):
    loss_scale._NO_FUSED_KERNEL.discard(("cuda", FP16))
    model, opt = _build(level, FP16, update="kahan" if level == "O3" else None)
    losses, skipped = _train(model, opt, _data())
    assert losses[-1] < 0.5 * losses[0] and all(torch.isfinite(torch.tensor(losses)))
    assert sum(skipped) <= 2  # at most the first overshooting scale
    assert ("cuda", FP16) not in loss_scale._NO_FUSED_KERNEL  # the fused kernel did the work
    assert opt.loss_scale >= 1.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_trains_and_its_finite_check_works(level):
    model, opt = _build(level, BF16)
    losses, skipped = _train(model, opt, _data(), poison_at={5})
    assert losses[-1] < 0.5 * losses[0]
    assert skipped[5] and sum(skipped) == 1  # the planted inf, found by the bf16 path


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=str)
def test_overflow_skip_leaves_weights_masters_and_state_bitwise_unchanged(dtype):
    model, opt = _build("O2", dtype)
    data = _data(6)
    _train(model, opt, data[:3])
    before = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.optimizer.state_dict()),
        [m.detach().clone() for _, m in opt._pairs],
    )
    scale = opt.loss_scale
    _, skipped = _train(model, opt, data[3:4], poison_at={0})
    assert skipped == [True]
    assert_tree_bitwise(model.state_dict(), before[0])
    assert_tree_bitwise(opt.optimizer.state_dict(), before[1])  # moments and step counts
    for (_, m), old in zip(opt._pairs, before[2]):
        assert_bitwise(m.detach(), old)
    if dtype == FP16:
        assert opt.loss_scale == scale / 2


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=str)
def test_one_host_sync_per_step(dtype):
    model, opt = _build("O2", dtype)
    data = _data(4)
    _train(model, opt, data[:2])  # warm up (lazy state, first verdict)
    torch.cuda.synchronize()
    x, y = data[2]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.backward(mse(model, x, y))
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_fused_adamw_behind_fp32_masters():
    data = _data(20)
    fused_model, fused_opt = _build("O2", FP16, fused=True)
    plain_model, plain_opt = _build("O2", FP16, fused=False)
    fused_losses, _ = _train(fused_model, fused_opt, data)
    _train(plain_model, plain_opt, data)
    assert fused_losses[-1] < 0.5 * fused_losses[0]
    for (_, a), (_, b) in zip(fused_opt._pairs, plain_opt._pairs):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("level", "dtype"), [("O1", FP16), ("O2", FP16), ("O2", BF16), ("O3", BF16)]
)
def test_resume_is_bit_exact_on_cuda(level, dtype):
    data = _data(10)
    straight = _build(level, dtype)
    _train(*straight, data, poison_at={2})
    model, opt = _build(level, dtype)
    _train(model, opt, data[:5], poison_at={2})
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(level, dtype)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _train(model, opt, data[5:])
    for a, b in zip(model.parameters(), straight[0].parameters()):
        assert_bitwise(a.detach(), b.detach())
    assert_tree_bitwise(opt.state_dict(), straight[1].state_dict())


def test_fp8_activations_pack_as_on_a_cpu_and_train_on_cuda(monkeypatch):
    from mixprec._core import activations
    from mixprec.fp8 import quantization

    g = torch.Generator().manual_seed(3)
    t = (torch.randn(6, 40, 96, generator=g) * torch.logspace(-3, 3, 6).view(6, 1, 1)).to(BF16)
    on_cpu = activations._Packed(activations._to_fp8(t), t).unpack()
    packed = activations._to_fp8(t.cuda())  # one expression on a GPU, slices on a CPU
    assert packed.data.device.type == "cuda" and packed.data.dtype == quantization.E4M3
    on_gpu = activations._Packed(packed, t).unpack()
    assert on_gpu.dtype == BF16 and on_gpu.shape == t.shape
    assert torch.equal(on_gpu.cpu(), on_cpu)

    stored = []
    original = activations.SavedTensorStorage._pack

    def pack(self, t):
        stored.append(original(self, t))
        return stored[-1]

    monkeypatch.setattr(activations.SavedTensorStorage, "_pack", pack)
    config = mixprec.ActivationConfig("fp8", min_numel=256)  # this model's tensors are small
    losses = {}
    for act in (None, config):
        model, opt = _build("O2", BF16, activations=act)
        losses[act], _ = _train(model, opt, _data(30))
    fp8 = [p for p in stored if isinstance(p, activations._Packed)]
    assert fp8 and all(p.data.data.device.type == "cuda" for p in fp8)  # packed on the GPU
    assert losses[config][-1] < 0.5 * losses[config][0]
    assert abs(losses[config][-1] - losses[None][-1]) < 0.1 * losses[None][-1]
