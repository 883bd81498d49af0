"""Helpers shared by the training tests (optimizer, checkpoints, initialize)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INF, NAN = float("inf"), float("nan")


def linear_run(fn, x: Tensor, w: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, ...]:
    """``fn(x, w, b)`` forward and backward from ``dy`` on fresh leaves: output and gradients."""
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


def batch(seed: int = 1, n: int = 8) -> tuple[Tensor, Tensor]:
    """A fixed regression batch for :func:`make_model`: inputs (n, 8), targets (n, 4)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def train(model: nn.Module, opt, steps: int, seed: int = 1) -> list[float]:
    """``steps`` mixprec steps on one fixed batch (so the loss must fall); returns the losses."""
    losses = []
    x, y = batch(seed)
    for _ in range(steps):
        loss = mse(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x).float() - y).pow(2).mean()


@contextlib.contextmanager
def poisoned(param: Tensor | None, value: float = INF):
    """While active, the gradient reaching ``param`` gets ``value`` in its first element."""
    if param is None:
        yield
        return

    def hook(g: Tensor) -> Tensor:
        g = g.clone()
        g.view(-1)[0] = value
        return g

    handle = param.register_hook(hook)
    try:
        yield
    finally:
        handle.remove()


_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bitwise(a: Tensor, b: Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype in _INT:
        a, b = a.view(_INT[a.dtype]), b.view(_INT[b.dtype])
    assert torch.equal(a, b)


def assert_tree_bitwise(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, Tensor):
        assert_bitwise(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_tree_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_bitwise(x, y)
    else:
        assert a == b


class TinyGPT(nn.Module):
    """nanoGPT's shape in miniature: token + position embeddings, a residual MLP, a final
    LayerNorm, and an lm_head whose weight *is* the token embedding's (weight tying);
    ``forward(idx, targets)`` returns ``(logits, loss)`` as nanoGPT's does."""

    def __init__(self, vocab: int = 16, n_embd: int = 8, block: int = 4):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 2 * n_embd)
        self.proj = nn.Linear(2 * n_embd, n_embd)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.proj(F.gelu(self.fc(self.ln_1(x))))
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)
        )

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type="cpu"):
        """nanoGPT's: weight decay on 2-D parameters only, fused AdamW on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        extra = {"fused": True} if device_type == "cuda" else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)
