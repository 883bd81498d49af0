"""Inference, export, numerics tools, the hardware check and real models on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from extras import need
from torch import nn

import mixprec
from mixprec.bench.models import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")


def test_check_reports_the_real_capability():
    report = mixprec.check("cuda", verbose=False)
    major, minor = torch.cuda.get_device_capability()
    assert report.name == torch.cuda.get_device_name()
    assert f"sm_{major}{minor}" in report.features
    assert report.dtypes["float16"].supported and report.dtypes["float16"].fast == (major >= 7)
    assert report.dtypes["bfloat16"].supported == (major >= 8)
    assert report.best_dtype == (torch.bfloat16 if major >= 8 else torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_for_inference_and_export_on_cuda(dtype, tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_embd=64, n_head=4)).cuda().eval()
    x = torch.randint(0, 96, (2, 16), device="cuda")
    fast = mixprec.for_inference(model, dtype, x)
    assert next(fast.parameters()).device.type == "cuda"
    with torch.no_grad():
        ref, out = model(x), fast(x)
    assert out.dtype == torch.float32
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999
    res = mixprec.inference.export(fast, x, tmp_path / "m.pt2", format="torch")
    assert res.cosine > 0.9999


def test_locate_and_range_audit_on_cuda_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    with torch.no_grad():
        model[2].weight.mul_(1e5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(
        model, opt, mixprec.Recipe("O1", torch.float16, loss_scale=None)
    )
    x = torch.randn(4, 8, device="cuda") * 1e2
    with mixprec.numerics.locate_nonfinite(model) as loc:
        model(x).float().sum().backward()
    assert loc.first is not None and loc.first.module == "2" and loc.first.phase == "forward"
    with mixprec.numerics.range_audit(model) as audit:
        model(x)
    assert audit.stats  # per-module statistics, gathered from CUDA tensors
    assert max(s.absmax for s in audit.stats.values()) > 1e3  # the scaled-up activations


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_gpt_trains_on_cuda(level):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_embd=64, n_head=4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    recipe = mixprec.Recipe(level, torch.bfloat16)
    model, opt = mixprec.initialize(
        model, opt, recipe.replace(update="kahan") if level == "O3" else recipe
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 96, (8, 33), device="cuda", generator=g)
    losses = []
    for _ in range(30):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_hf_llama_trains_on_cuda_at_o2():
    transformers = need("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    ids = torch.randint(
        0, 128, (4, 32), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
    )
    losses = []
    for _ in range(25):
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0] and all(torch.isfinite(torch.tensor(losses)))
