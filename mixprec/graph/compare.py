"""Compare the dtypes the graph pass runs each op in with the eager engine's, op by op.

Both sides run under one ``TorchDispatchMode`` that records every ATen op that returns a
floating tensor, with its output dtype. Recording at dispatch level makes the two comparable:
``linear`` becomes the same ``t`` + ``addmm`` either way, and casts (``_to_copy``) are left out
since placing them differently is the point of the pass. Each difference comes with the graph
report's reason for the graph side's choice.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["compare_with_eager", "op_dtypes"]

_SKIP = frozenset(
    {
        "_to_copy",
        "to",
        "copy_",
        "detach",
        "clone",
        "alias",
        "lift_fresh",
        "_assert_tensor_metadata",
        "empty",
        "empty_like",
        "zeros",
        "ones",
        "full",
    }
)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Counter[str]] = defaultdict(Counter)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if name not in _SKIP and isinstance(first, torch.Tensor) and first.is_floating_point():
            self.seen[name][str(first.dtype).replace("torch.", "")] += 1
        return out


def op_dtypes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, dict[str, int]]:
    """``{aten op: {output dtype: count}}`` over one call of ``fn`` (forward only, no grad)."""
    rec = _Recorder()
    with torch.no_grad(), rec:
        fn(*args, **kwargs)
    return {k: dict(v) for k, v in sorted(rec.seen.items())}


def compare_with_eager(
    model: torch.nn.Module, converted: Any, *inputs: Any, **kwargs: Any
) -> list[dict[str, Any]]:
    """Ops whose dtypes differ between ``mixprec.autocast`` on ``model`` and ``converted``.

    ``converted`` is ``mixprec.convert(model, ...)`` (they share parameters). Returns one entry
    per differing op: ``{"op", "eager", "graph", "why"}``; an empty list means they agree.
    """
    from mixprec._core.engine import autocast
    from mixprec.recipe import Recipe

    options = converted.options
    if options["fp32_inside"]:
        raise ValueError(
            "compare_with_eager compares against mixprec.autocast, which has no "
            "fp32_inside switch: convert with fp32_inside=False to compare."
        )
    region = Recipe("O1", converted.policy.compute_dtype, kernels=options["kernels"])
    with autocast(region):
        eager = op_dtypes(model, *inputs, **kwargs)
    graph = op_dtypes(converted, *inputs, **kwargs)
    report = converted.precision_report()
    reasons: dict[str, list[str]] = defaultdict(list)
    for row in report.nodes:
        reasons[row.op].append(f"{row.name}: {row.dtype} ({row.list}: {row.reason})")
    out = []
    for op in sorted(set(eager) | set(graph)):
        if eager.get(op) != graph.get(op):
            out.append(
                {
                    "op": op,
                    "eager": eager.get(op, {}),
                    "graph": graph.get(op, {}),
                    "why": reasons.get(op, ["not a node of the graph (inside a composite)"]),
                }
            )
    return out
