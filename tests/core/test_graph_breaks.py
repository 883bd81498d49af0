"""A graph break inside a compiled mixprec model: the region survives it, and the compiler's
traces leave the thread's stack as they found it, so plain torch afterwards is untouched."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func

import mixprec
from mixprec._core import _frames, traced
from mixprec._core.hardware import MixprecPerformanceWarning

BF16 = torch.bfloat16
FRAME_OPS = {"mixprec::enter_frame": "enter", "mixprec::exit_frame": "exit"}  # at first use

pytestmark = pytest.mark.skipif(
    not traced.dynamo_traces_autocast_setters(),
    reason="torch < 2.13 runs the engine's push and pop eagerly (a graph break at each)",
)

SEEN: list[tuple[int, bool, torch.dtype]] = []


@torch._dynamo.disable
def _look(h: torch.Tensor, w: torch.Tensor) -> None:
    """Eager code at a graph break: the stack's depth, autocast's switch, a matmul's dtype."""
    SEEN.append((_frames.depth(), torch.is_autocast_enabled("cpu"), (h @ w.t()).dtype))


class _Net(nn.Module):
    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.ln(x))
        if self.breaks:
            _look(h, self.b.weight)
        return self.ln(self.b(h)).softmax(-1)  # after the break: an fp32-inside norm, softmax


def _model(breaks: bool, level: str = "O2") -> nn.Module:
    torch.manual_seed(0)
    net = _Net(breaks)
    model, _ = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), level, BF16)
    return model


def _capturing() -> tuple[object, list[torch.fx.GraphModule]]:
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler), graphs


def _frame_ops(graphs: list[torch.fx.GraphModule]) -> list[str]:
    names = [getattr(n.target, "name", lambda: "")() for gm in graphs for n in gm.graph.nodes]
    return [FRAME_OPS[name] for name in names if name in FRAME_OPS]


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_region_split_by_a_graph_break_runs_as_in_eager_mode(backend, level):
    torch._dynamo.reset()  # also drops dynamo's compile callbacks: mixprec adds them back
    model, reference = _model(True, level), _model(True, level)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    x, x_ref = X.clone().requires_grad_(True), X.clone().requires_grad_(True)
    want = reference(x_ref)
    want.sum().backward()
    for call in range(3):
        got = compiled(x)
        assert _frames.depth() == 0, _frames._state.frames
        assert SEEN[-1] == (1, True, BF16)  # the break's eager code ran inside the region
        if backend == "inductor":
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-2)
        else:
            assert torch.equal(got, want)
        x.grad = None
        got.sum().backward()
        assert _frames.depth() == 0
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-3, rtol=1e-2)
        if call == 0:
            frames = counter.frame_count
    assert counter.frame_count == frames  # no recompilation on later calls
    with torch.autocast("cpu", BF16):  # plain torch: its own rule (softmax stays bf16 on CPU)
        assert torch.randn(4, 4).to(BF16).softmax(-1).dtype == BF16


def test_a_whole_region_in_one_graph_records_no_frame_ops():
    torch._dynamo.reset()
    backend, graphs = _capturing()
    model = _model(False)
    explained = torch._dynamo.explain(model)(X)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(X.clone().requires_grad_(True))
    out.sum().backward()
    assert graphs and _frame_ops(graphs) == []  # no run-time cost
    assert torch.equal(out, model(X)) and _frames.depth() == 0


def test_a_split_region_keeps_its_push_and_pop_as_ops():
    torch._dynamo.reset()
    backend, graphs = _capturing()
    torch.compile(_model(True), backend=backend)(X)
    ops = _frame_ops(graphs)
    assert ops.count("enter") >= 1 and ops.count("exit") == ops.count("enter")
    assert _frames.depth() == 0


def test_a_compiled_split_model_inside_an_eager_region_keeps_the_outer_frame():
    torch._dynamo.reset()
    model = _model(True)
    with mixprec.autocast(BF16):  # (a float16 one fails dynamo's global-state check: torch's)
        outer = _frames.top()
        torch.compile(model, backend="aot_eager")(X)
        assert _frames._state.frames == [outer]
    assert _frames.depth() == 0


def test_a_split_mixprec_autocast_region_says_what_it_loses(monkeypatch):
    """A ``mixprec.autocast`` region sets autocast's state itself: split under AOTAutograd,
    the rest of it runs without mixed precision, and a warning says so; a module's is kept."""
    torch._dynamo.reset()
    monkeypatch.setattr(traced, "_warned", [])
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast(BF16):
            h = a(x)
            _look(h, b.weight)
            return b(h).float()

    with pytest.warns(MixprecPerformanceWarning, match="split a mixprec.autocast region"):
        torch.compile(f, backend="aot_eager")(X)
    assert SEEN[-1] == (1, False, torch.float32) and _frames.depth() == 0
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixprecPerformanceWarning)
        traced._warned.clear()
        torch.compile(_model(True), backend="aot_eager")(X)  # a module's region: no warning


def test_torch_compile_of_plain_code_after_a_split_region_is_plain():
    torch._dynamo.reset()
    torch.compile(_model(True), backend="aot_eager")(X)

    def plain(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return (x @ x.t()).softmax(-1)

    assert torch.equal(torch.compile(plain, backend="aot_eager")(X), plain(X))
    assert plain(X).dtype == BF16 and _frames.depth() == 0


def test_a_module_policy_nested_in_a_compiled_model_compiles_to_one_graph():
    """The inner boundary reads the outer region's setting while dynamo traces: no guard on
    the thread's stack (one on its trace-time frames failed to build)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    model, _ = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O1", BF16)
    mixprec.set_policy(net[2], "float32")  # the head in float32
    explained = torch._dynamo.explain(model)(X)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(model, backend="aot_eager")(X)
    assert got.dtype == torch.float32 and torch.equal(got, model(X))
    assert _frames.depth() == 0
