"""Plain torch code -- no mixprec in it -- whose results must not depend on mixprec being loaded.

``python tests/plain_torch_scenarios.py OUT`` runs every scenario in a process that never
imports mixprec and saves the results to OUT; ``tests/test_leaves_torch_alone.py`` runs the
same scenarios in a process where mixprec has registered its kernels and trained a model, and
compares bit for bit. The scenarios cover each way torch runs an autocast kernel: eager, fake
tensors under dynamo and AOTAutograd, inductor, torch.func transforms, torch.export, activation
checkpointing in backward, and the in-place updates and clipping mixprec also hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

BF16 = torch.bfloat16
LIST_GROUPS = (
    ("torch_16", torch),
    ("nn_16", torch._C._nn),
    ("torch_fp32", torch),
    ("nn_fp32", torch._C._nn),
    ("torch_need_autocast_promote", torch),
    ("torch_expect_builtin_promote", torch),
    ("methods_expect_builtin_promote", None),
)


def autocast_list_cases() -> list[tuple[str, Callable, tuple, dict]]:
    """torch's own CPU autocast test lists (``torch.testing._internal.autocast_test_lists``)."""
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

    torch.manual_seed(0)
    lists = AutocastCPUTestLists(torch.device("cpu"))
    cases = []
    for attr, namespace in LIST_GROUPS:
        for entry in getattr(lists, attr):
            name, args = entry[0], entry[1]
            kwargs = next((e for e in entry[2:] if isinstance(e, dict)), {})
            fn = getattr(namespace, name) if namespace is not None else getattr(torch.Tensor, name)
            cases.append((f"{attr}.{name}", fn, args, kwargs))
    return cases


def _under_autocast(fn: Callable, kwargs: dict, dtype: torch.dtype) -> Callable:
    def run(*args: Any) -> Any:
        with torch.autocast("cpu", dtype):
            return fn(*args, **kwargs)

    return run


def _outcome(fn: Callable, *args: Any) -> Any:
    """What ``fn(*args)`` returns, or the error it raises (which must not change either)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- the error is the result
        return f"{type(e).__name__}: {e}"


def op_lists(out: dict[str, Any]) -> None:
    for label, fn, args, kwargs in autocast_list_cases():
        out[f"eager.bf16.{label}"] = _outcome(_under_autocast(fn, kwargs, BF16), *args)
        out[f"eager.fp16.{label}"] = _outcome(_under_autocast(fn, kwargs, torch.float16), *args)
        torch._dynamo.reset()  # each op its own compile (one code object, many ops)
        compiled = torch.compile(
            _under_autocast(fn, kwargs, BF16), backend="aot_eager", fullgraph=True
        )
        out[f"compiled.bf16.{label}"] = _outcome(compiled, *args)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))


def compiled_model(out: dict[str, Any]) -> None:
    """A plain model trained one step under torch.autocast + torch.compile (inductor)."""
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", BF16):
        y = torch.compile(model)(x)
    y.float().pow(2).mean().backward()
    out["inductor.output"] = y
    out["inductor.grads"] = [p.grad for p in model.parameters()]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_under_autocast(_model(), {}, BF16))(x)
    out["inductor.graph_breaks"] = torch.tensor(explained.graph_break_count)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        return torch.exp(h).softmax(-1) * h.sum(-1, keepdim=True)


def checkpointing(out: dict[str, Any]) -> None:
    """torch.utils.checkpoint under a plain torch.autocast: recomputed in backward."""
    for reentrant in (False, True):
        torch.manual_seed(0)
        block = _Block()
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", BF16):
            y = checkpoint(block, x, use_reentrant=reentrant)
        y.float().sum().backward()
        out[f"checkpoint.{reentrant}"] = [y, x.grad, *(p.grad for p in block.parameters())]


def functorch(out: dict[str, Any]) -> None:
    """torch.func transforms over code that enters torch.autocast."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    xs = torch.randn(3, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            h = F.layer_norm(x @ w, (8,))
            return torch.softmax(h, -1).float().pow(2).sum() + torch.exp(h).float().sum()

    out["func.grad"] = torch.func.grad(f)(xs[0])
    out["func.vmap"] = torch.func.vmap(f)(xs)
    out["func.vmap_grad"] = torch.func.vmap(torch.func.grad(f))(xs)

    def update(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            p = p.clone()
            p.mul_(0.9).add_(g, alpha=-0.1)
            return p

    out["func.vmap_inplace"] = torch.func.vmap(update)(xs, xs.flip(0))


class _AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return torch.softmax(F.layer_norm(self.fc(x), (8,)), -1)


def exported(out: dict[str, Any]) -> None:
    """torch.export of a model that enters torch.autocast in its forward."""
    torch.manual_seed(0)
    model = _AutocastInside()
    x = torch.randn(2, 8)
    program = torch.export.export(model, (x,))
    out["export.output"] = program.module()(x)
    out["export.ops"] = sorted(
        str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"
    )


def inplace_and_clipping(out: dict[str, Any]) -> None:
    """In-place updates inside torch.autocast (eager and compiled) and gradient clipping."""
    torch.manual_seed(0)
    model = _model()
    x = torch.randn(4, 64)
    with torch.autocast("cpu", BF16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    out["clip.norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    out["clip.grads"] = [p.grad.clone() for p in model.parameters()]
    torch._dynamo.reset()
    clip = torch.compile(torch.nn.utils.clip_grad_norm_, backend="aot_eager", fullgraph=True)
    out["clip.compiled_norm"] = clip(list(model.parameters()), 1e-4)
    out["clip.compiled_grads"] = [p.grad.clone() for p in model.parameters()]

    def sgd(params: list[torch.Tensor]) -> None:
        with torch.no_grad(), torch.autocast("cpu", BF16):
            for p in params:
                p.mul_(0.99).add_(p.grad, alpha=-0.5).clamp_(-1, 1)

    sgd(list(model.parameters()))
    torch._dynamo.reset()
    torch.compile(sgd, backend="aot_eager")(list(model.parameters()))
    with torch.autocast("cpu", BF16):
        out["inplace.after"] = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.autocast("cpu", BF16):
        opt.step()
        out["optimizer.after"] = model(x)
    torch._dynamo.reset()  # a compiled optimizer step: same graphs, same breaks
    explained = torch._dynamo.explain(opt.step)()
    out["optimizer.compiled"] = torch.tensor([explained.graph_count, explained.graph_break_count])
    out["optimizer.compiled_after"] = model(x)


def recurrent(out: dict[str, Any]) -> None:
    """LSTM/GRU/RNN under torch.autocast: torch lowers the ops they decompose into."""
    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        for dtype in (torch.float32, BF16):
            torch.manual_seed(0)
            net = cls(8, 8).to(dtype)
            x = torch.randn(5, 3, 8, requires_grad=True)

            def run(net: nn.Module = net, x: torch.Tensor = x) -> Any:
                with torch.autocast("cpu", BF16):
                    y = net(x)[0]
                y.float().sum().backward()
                return y, x.grad, next(net.parameters()).grad

            out[f"recurrent.{cls.__name__}.{dtype}"] = _outcome(run)
            compiled = torch.compile(net, backend="aot_eager")
            with torch.autocast("cpu", BF16):
                out[f"recurrent.{cls.__name__}.{dtype}.compiled"] = _outcome(
                    lambda c=compiled, x=x: c(x)[0]
                )


SCENARIOS = (
    op_lists,
    compiled_model,
    checkpointing,
    functorch,
    exported,
    inplace_and_clipping,
    recurrent,
)


def run_all() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        scenario(out)
    return {k: _detach(v) for k, v in out.items()}


def _detach(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (list, tuple)):
        return [_detach(x) for x in v]
    return v


if __name__ == "__main__":
    assert "mixprec" not in sys.modules
    results = run_all()
    assert "mixprec" not in sys.modules
    torch.save(results, sys.argv[1])
