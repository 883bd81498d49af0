"""A graph break inside a compiled mixprec model: the compiler's traces leave the thread's stack
as they found it, so plain torch afterwards is untouched; the split is said once, and with
dynamo's eager backend the split region still runs as eager mode does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import mixprec
from mixprec.core import dispatch, traced
from mixprec.core.hardware import MixprecPerformanceWarning

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    not traced.dynamo_traces_autocast_setters(),
    reason="torch < 2.13 runs the engine's push and pop eagerly (a graph break at each)",
)


SEEN: list[tuple[int, torch.dtype]] = []


@torch._dynamo.disable
def _look(h: torch.Tensor, w: torch.Tensor) -> None:
    """Eager code at a graph break: the stack's depth, and an op's dtype under the region."""
    SEEN.append((dispatch.depth(), (h @ w.t()).dtype))


class _Net(nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.ln(x))
        if self.breaks:
            _look(h, self.b.weight)
        return self.b(h).softmax(-1)


def _model(breaks: bool, level: str = "O2") -> nn.Module:
    torch.manual_seed(0)
    net = _Net(breaks)
    model, _ = mixprec.initialize(
        net, torch.optim.SGD(net.parameters(), lr=0.1), level=level, dtype=BF16
    )
    return model


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_graph_break_inside_a_region_leaves_no_frame_behind(backend, level):
    torch._dynamo.reset()  # also drops dynamo's compile callbacks: mixprec adds them back
    model, reference = _model(True, level), _model(True, level)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    want = reference(X)
    x = X.clone().requires_grad_(True)
    for call in range(3):
        got = compiled(x)
        assert dispatch.depth() == 0, dispatch._state.frames
        assert got.dtype == want.dtype and torch.isfinite(got).all()
        if backend == "eager":  # dynamo's graphs run as Python: the region as in eager mode
            assert SEEN[-1] == (1, BF16)
            assert torch.equal(got, want)
        got.sum().backward()
        assert dispatch.depth() == 0
        if call == 0:
            frames = counter.frame_count
    assert counter.frame_count == frames  # no recompilation on later calls
    with torch.autocast("cpu", BF16):  # plain torch: its own rule (softmax stays bf16 on CPU)
        assert torch.randn(4, 4).to(BF16).softmax(-1).dtype == BF16


def test_after_the_break_the_region_runs_without_its_casts_and_says_so(monkeypatch):
    """What AOTAutograd backends give (it runs compiled graphs with autocast disabled): the
    Linear after the break runs in float32. Pinned, so a torch that changes this shows up."""
    torch._dynamo.reset()
    monkeypatch.setattr(traced, "_warned", [])
    model = _model(True, "O1")
    with torch.no_grad():
        h = model.a(model.ln(X))
        after = F.linear(h.float(), model.b.weight, model.b.bias).softmax(-1)
        with pytest.warns(MixprecPerformanceWarning, match="split a mixprec region"):
            got = torch.compile(model, backend="aot_eager")(X)
    assert SEEN[-1] == (0, torch.float32)
    assert torch.equal(got, after)


def test_a_whole_region_in_one_graph_is_not_split():
    torch._dynamo.reset()
    model = _model(False)
    explained = torch._dynamo.explain(model)(X)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixprecPerformanceWarning)
        traced._warned.clear()
        out = torch.compile(model, backend="aot_eager")(X.clone().requires_grad_(True))
    assert torch.equal(out, model(X))
    out.sum().backward()
    assert dispatch.depth() == 0


def test_a_compiled_region_inside_an_eager_region_keeps_the_outer_frame():
    torch._dynamo.reset()
    model = _model(True)
    with mixprec.autocast(BF16):  # (a float16 one fails dynamo's global-state check: torch's)
        outer = dispatch.top()
        torch.compile(model, backend="aot_eager")(X)
        assert dispatch._state.frames == [outer]
    assert dispatch.depth() == 0


def test_torch_compile_of_plain_code_after_a_split_region_is_plain():
    torch._dynamo.reset()
    torch.compile(_model(True), backend="aot_eager")(X)

    def plain(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return (x @ x.t()).softmax(-1)

    assert torch.equal(torch.compile(plain, backend="aot_eager")(X), plain(X))
    assert plain(X).dtype == BF16 and dispatch.depth() == 0
