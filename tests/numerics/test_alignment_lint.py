"""Alignment lint flags exactly the misaligned dimensions, with the padding fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50257, 64)  # width aligned; vocab reported on the tied head
        self.conv = nn.Conv2d(3, 16, 3)  # 3 input channels
        self.gconv = nn.Conv2d(16, 20, 1, groups=4)  # 4 in / 5 out per group
        self.proj = nn.Linear(30, 64)  # in 30
        self.mha = nn.MultiheadAttention(48, 4)  # head_dim 12
        self.rnn = nn.LSTM(24, 20)  # hidden 20
        self.ok = nn.Linear(64, 128)
        self.head = nn.Linear(64, 50257, bias=False)
        self.head.weight = self.emb.weight


def _found(report):
    return {(f.module, f.dim, f.value, f.suggested) for f in report.findings}


def test_lint_flags_the_right_dims_and_no_others():
    report = mixprec.numerics.lint(Toy(), torch.float16, batch_size=3, seq_len=5)
    assert _found(report) == {
        ("conv", "in_channels per group", 3, 8),
        ("gconv", "in_channels per group", 4, 8),
        ("gconv", "out_channels per group", 5, 8),
        ("proj", "in_features", 30, 32),
        ("mha", "head_dim", 12, 16),
        ("rnn", "hidden_size", 20, 24),
        ("head", "vocab_size", 50257, 50304),
        ("", "tokens per batch (batch_size*seq_len)", 15, 16),
    }
    vocab = next(f for f in report.findings if f.dim == "vocab_size")
    assert "pad vocab from 50257 to 50304" in vocab.message
    assert "pad vocab from 50257 to 50304" in str(report)


def test_gpt_with_aligned_dims_is_clean_and_fp32_has_no_rule():
    from mixprec.bench.models import GPT

    assert not mixprec.numerics.lint(GPT(), torch.bfloat16)
    assert len(mixprec.numerics.lint(Toy(), torch.float32)) == 0


def test_targets_change_the_multiple():
    from mixprec.bench.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=6, n_embd=384))
    tpu = mixprec.numerics.lint(model, "bf16", target="tpu")
    assert _found(tpu) == {
        ("blocks.0.attn", "head_dim", 64, 128),
        ("head", "out_features", 96, 128),
    }
    cpu = mixprec.numerics.lint(nn.Linear(24, 32), torch.bfloat16, target="cpu")
    assert _found(cpu) == {("", "in_features", 24, 32)}
    assert mixprec.numerics.lint(model, torch.float16).as_dict()["findings"] == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        mixprec.numerics.lint(nn.Linear(8, 8), torch.float16, target="fpga")
    with pytest.raises(ValueError, match="batch_size"):
        mixprec.numerics.lint(nn.Linear(8, 8), torch.float16, batch_size=0)
    with pytest.raises(TypeError, match="nn.Module"):
        mixprec.numerics.lint("model", torch.float16)
