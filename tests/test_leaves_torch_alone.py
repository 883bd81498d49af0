"""mixprec leaves torch alone: after mixprec has registered its kernels and trained a model,
plain torch code -- torch's own autocast op lists, a compiled model, checkpointing, torch.func,
torch.export, in-place updates, clipping -- gives bit for bit what a process that never
imported mixprec gives. And mixprec's own compiled paths raise no warnings."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec._core.hardware import MixprecPerformanceWarning

pytest.importorskip("expecttest")  # torch's autocast test lists import it
import plain_torch_scenarios as scenarios

BF16 = torch.bfloat16


def _use_mixprec() -> None:
    """Register every kernel mixprec has, leave checkpoint spans and clipping masters behind."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
            self.b = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(self.a, x, use_reentrant=False).softmax(-1))

    for level, dtype in (("O2", BF16), ("O1", torch.float16)):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, level, dtype)
        opt.backward(model(torch.randn(2, 8)).sum())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with mixprec.autocast(dtype):
            torch.softmax(torch.randn(2, 3), -1).sum()
    # mixprec.amp: a scaler step and regions with mixprec's table, nested in another dtype
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.amp.GradScaler("cpu", hysteresis=2)
    with mixprec.amp.autocast("cpu", torch.float16, cast_rules="mixprec"):
        with mixprec.amp.autocast("cpu", BF16, cast_rules={torch.softmax: "fp32"}):
            loss = model(torch.randn(2, 8)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    # FP8 layers, by initialize and in an autocast region (a global module hook while it runs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecPerformanceWarning)
        fp8 = mixprec.FP8Config(layers="all")
        mlp = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4))
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
        mlp, opt = mixprec.initialize(mlp, opt, mixprec.Recipe("O2", BF16, fp8=fp8))
        opt.backward(mlp(torch.randn(4, 16)).float().sum())
        opt.step()
        plain = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4))
        with mixprec.autocast(mixprec.Recipe("O1", BF16, fp8=fp8)):
            plain(torch.randn(4, 16)).float().sum().backward()
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert mixprec._core._autocast_rules.registered()


def _assert_same(ref, got, where: str) -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), where
        for i, (r, g) in enumerate(zip(ref, got)):
            _assert_same(r, g, f"{where}[{i}]")
    else:
        assert got == ref, where


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("plain") / "reference.pt"
    script = Path(__file__).with_name("plain_torch_scenarios.py")
    subprocess.run([sys.executable, str(script), str(path)], check=True, timeout=600)
    return torch.load(path)


def test_plain_torch_code_is_bitwise_unchanged_by_mixprec(reference):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecPerformanceWarning)
        _use_mixprec()
    got = scenarios.run_all()
    assert set(got) == set(reference)
    assert sum(k.startswith("compiled.bf16.") for k in got) >= 50  # the lists were all run
    for key in sorted(reference):
        _assert_same(reference[key], got[key], key)


def test_the_reported_compile_under_a_users_autocast_runs():
    """After initialize, compiling a different plain model under torch.autocast used to hit a
    RecursionError in fake-tensor propagation (mixprec's kernel redispatched to itself through
    the Python dispatcher)."""
    a = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecPerformanceWarning)
        mixprec.initialize(a, torch.optim.SGD(a.parameters(), lr=0.1), "O2", BF16)
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    with torch.autocast("cpu", BF16):
        got = torch.compile(m, backend="aot_eager")(x)
        want = m(x)
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_users_checkpoint_under_torch_autocast_is_not_recomputed_with_mixprec_rules():
    """Backward recomputation used to take the last mixprec frame of the dtype, so a plain
    checkpointed exp recomputed in fp32 and torch raised "different metadata"."""
    _use_mixprec()
    torch.manual_seed(0)
    fc = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", BF16):
        y = checkpoint(lambda t: torch.exp(fc(t)), x, use_reentrant=False)
    assert y.dtype == BF16
    y.float().sum().backward()  # raised CheckpointError before
    assert x.grad is not None and torch.isfinite(x.grad).all()


def _compile_warnings(fn, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_compiling_an_initialized_model_raises_no_warning(level):
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    torch.compile(nn.Linear(16, 16), backend="aot_eager")(x)  # torch's own first-use warnings
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecPerformanceWarning)
        model, opt = mixprec.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), level, BF16
        )
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")

    def train_twice(x):
        for _ in range(2):
            opt.backward(compiled(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()

    assert _compile_warnings(train_twice, x) == []


def test_a_compiled_function_with_a_mixprec_region_raises_no_warning():
    """The region's slow-dtype check reads a cached hardware report: not while tracing (dynamo
    warned about the functools cache and the file read)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))

    def f(x):
        with mixprec.autocast(BF16):
            return model(x)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixprecPerformanceWarning)
        f(x)  # eager: warns once about slow bf16 where it is slow; that one is intended
    assert _compile_warnings(compiled, x) == []
