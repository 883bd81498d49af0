"""FP8 on a GPU with FP8 tensor cores (compute capability >= 8.9): torch's real _scaled_mm
kernels, the recipes' numbers, compiled == eager, training, and the warnings."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec import FP8Config
from mixprec._core import traced
from mixprec.bench.models import GPT, GPTConfig
from mixprec.fp8 import fp8_plan
from mixprec.fp8 import layers as fp8_layers
from mixprec.fp8.config import RECIPES
from mixprec.fp8.linear import fp8_linear
from mixprec.fp8.quantization import E4M3, dequantize, quantize, scale_for, sqnr
from tests.training_helpers import linear_run

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="needs FP8 tensor cores (compute capability >= 8.9)",
)
ALL = FP8Config(layers="all")


class CountScaled(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ == "_scaled_mm"
        return func(*args, **(kwargs or {}))


def _layer(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    return x, w, b, dy


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_fp8_linear_numbers_and_compile_equals_eager(recipe):
    r = RECIPES[recipe]
    x, w, b, dy = _layer(250, 512, 384)  # 250 tokens: the weight-gradient GEMM pads to 256
    ref = linear_run(F.linear, x, w, b, dy)

    def fn(x, w, b):
        return fp8_linear(x, w, b, r, torch.bfloat16)

    with CountScaled() as c:
        out = linear_run(fn, x, w, b, dy)
    assert c.n == 3
    assert sqnr(ref[0], out[0]) >= 18 and sqnr(ref[2], out[2]) >= 17
    assert sqnr(ref[1], out[1]) >= 17
    for t in (x, w):
        assert sqnr(t, dequantize(quantize(t, E4M3, -1 if r.rowwise else None))) >= 25
    torch._dynamo.reset()
    compiled = linear_run(torch.compile(fn, fullgraph=True), x, w, b, dy)
    for e, c in zip(out, compiled):
        assert e.dtype == c.dtype and torch.equal(e, c)


def _gpt(n_embd=256, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=n_embd)
    return GPT(cfg).cuda()


def _step(model, opt, x):
    loss = F.cross_entropy(model(x).float().reshape(-1, 512), x.reshape(-1))
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_cuda_scales_eager_and_compiled_equal_the_cpus_bit_for_bit():
    """The scale is the correctly rounded 448 / amax on every backend: computed in float64, so
    compiled code is exact too (Triton's float32 division is approximate)."""
    bits = torch.randint(0, 0x7F800000, (1 << 16,), generator=torch.Generator().manual_seed(0))
    amax = bits.to(torch.int32).view(torch.float32).clamp(min=1e-12)
    cpu = scale_for(amax, E4M3)
    assert torch.equal(scale_for(amax.cuda(), E4M3).cpu(), cpu)
    compiled = torch.compile(lambda a: scale_for(a, E4M3), fullgraph=True)
    assert torch.equal(compiled(amax.cuda()).cpu(), cpu)


def test_cuda_gpt_trains_with_fp8_compiled_without_graph_breaks():

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", torch.bfloat16, fp8=ALL))
    x = torch.randint(0, 512, (8, 128), device="cuda")
    with CountScaled() as c:
        _step(model, opt, x)
    assert c.n == 3 * 8  # eager: every block Linear, three GEMMs each
    bf16 = mixprec.initialize(_gpt(), None, "O2", torch.bfloat16)
    torch._dynamo.reset()
    breaks = torch._dynamo.explain(model)(x).graph_break_count
    torch._dynamo.reset()
    baseline = torch._dynamo.explain(bf16)(x).graph_break_count
    assert breaks == baseline  # FP8 adds none (torch < 2.13 breaks at the engine's boundary)
    if traced.dynamo_traces_autocast_setters():
        assert breaks == 0
    torch._dynamo.reset()
    compiled = torch.compile(model)
    losses = [_step(compiled, opt, x) for _ in range(30)]
    assert losses[-1] < losses[0] - 1.0 and opt.skipped_steps == 0


def test_cuda_eager_fp8_warns_once_to_compile(monkeypatch):
    monkeypatch.setattr(fp8_layers, "_warned", {"cpu"})
    model = mixprec.initialize(_gpt(), None, mixprec.Recipe("O2", torch.bfloat16, fp8=ALL))
    x = torch.randint(0, 512, (2, 128), device="cuda")
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        model(x)
        model(x)
    eager = [w for w in seen if "outside torch.compile" in str(w.message)]
    assert len(eager) == 1


def test_cuda_plan_is_judged_for_this_gpu_and_check_reports_fp8():
    report = mixprec.check("cuda", verbose=False)
    assert report.fp8 is not None and report.fp8.supported and report.fp8.fast
    plan = fp8_plan(_gpt(n_embd=1024), torch.randint(0, 512, (1, 64), device="cuda"))
    name = torch.cuda.get_device_name()
    if "H100" in name or "H200" in name:
        assert plan.target in ("h100", "h200")


def test_cuda_fp8_saved_inputs_lower_the_compiled_peak():
    peaks = {}
    for label, fp8 in (("bf16", None), ("fp8", ALL)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = _gpt(n_embd=512)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", torch.bfloat16, fp8=fp8))
        compiled = torch.compile(model)
        x = torch.randint(0, 512, (32, 128), device="cuda")
        _step(compiled, opt, x)
        torch.cuda.reset_peak_memory_stats()
        _step(compiled, opt, x)
        peaks[label] = torch.cuda.max_memory_allocated()
        del model, opt, compiled
    assert peaks["fp8"] < peaks["bf16"], peaks
