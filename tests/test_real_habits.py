"""Habits of real training code that mixprec must get right: sparse embeddings, complex
parameters, frozen parameters, buffers, loading weights after initialize, clipping."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec

LEVELS = [("O0", None), ("O1", torch.bfloat16), ("O2", torch.bfloat16), ("O3", torch.bfloat16),
          ("O2", torch.float16)]
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.MixprecPerformanceWarning")


def _train(model, opts, batches, loss_fn):
    losses = []
    for batch in batches:
        loss = loss_fn(model, *batch)
        with mixprec.scale_loss(loss, opts) as scaled:
            scaled.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level,dtype", LEVELS, ids=[f"{lv}-{d}" for lv, d in LEVELS])
def test_sparse_embedding_with_sparse_adam_trains_at_every_level(level, dtype):
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1)
    model = nn.Sequential(emb, head)
    opts = [torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
            torch.optim.Adam(head.parameters(), lr=0.05)]
    model, opts = mixprec.initialize(model, opts, level=level, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 50, (16, 4), generator=g), torch.randn(16, 4, 1, generator=g)
    losses = _train(model, opts, [(ids, y)] * 30,
                    lambda m, i, t: (m(i).float() - t).pow(2).mean())
    assert losses[-1] < 0.5 * losses[0]
    assert opts[0].skipped_steps == 0


def test_sparse_gradient_with_an_inf_is_skipped():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    emb, opt = mixprec.initialize(emb, opt, level="O2", dtype=torch.bfloat16)
    before = emb.weight.detach().clone()
    out = emb(torch.tensor([1, 2])).float().sum() * float("inf")
    opt.backward(out)
    opt.step()
    assert opt.step_skipped and torch.equal(emb.weight.detach(), before)


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.phase = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x):
        h = self.lin(x).float()
        return (h * self.phase).abs()


@pytest.mark.parametrize("level,dtype", LEVELS[:3], ids=[f"{lv}-{d}" for lv, d in LEVELS[:3]])
def test_complex_parameters_train_and_stay_complex(level, dtype):
    torch.manual_seed(0)
    model = _Complex()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = mixprec.initialize(model, opt, level=level, dtype=dtype)
    assert model.phase.dtype == torch.complex64
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    losses = _train(model, [opt], [(x,)] * 25, lambda m, a: (m(a) - 1).pow(2).mean())
    assert losses[-1] < 0.5 * losses[0] and opt.skipped_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.phase.grad is None or model.phase.grad.dtype == torch.complex64


def test_fp16_o3_with_adamw_and_no_update_mode_trains():
    """The default used to step AdamW in fp16: NaN weights on step 1, then every step skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.initialize(model, opt, level="O3", dtype=torch.float16)
    assert opt.lean is not None  # the update runs in fp32 temporaries
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    losses = _train(model, [opt], [(x, y)] * 30,
                    lambda m, a, b: (m(a).float() - b).pow(2).mean())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0] and opt.skipped_steps <= 3
