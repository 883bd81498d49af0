"""The graph pass in one call: colour a graph, rewrite its casts, pick faster kernels.

:func:`rewrite` is what :func:`mixprec.convert` runs on a torch.export graph and what the
``torch.compile`` backend runs on a dynamo graph; tests run it on hand-built graphs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from mixprec._core import attention
from mixprec.graph import casts, paint

__all__ = ["PassResult", "auto_attention", "rewrite"]


@dataclass
class PassResult:
    """The colouring and the rewrite of one graph, with the settings that produced them."""

    colouring: paint.Colouring
    rewrite: casts.Rewrite
    dtype: torch.dtype
    graph: fx.Graph


def auto_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` that takes mixprec's measured-faster path when it applies.

    Same rule as the eager engine with ``kernels="auto"`` (see :mod:`mixprec._core.attention`).
    """
    out = attention.try_decomposed_attention(args, kwargs)
    if out is not None:
        return out
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def _stored_dtype(gm: fx.GraphModule, n: fx.Node) -> torch.dtype | None:
    """The dtype of a weight or input node (the tensor itself for get_attr), else None."""
    if n.op == "get_attr":
        t = casts._attr(gm, n.target)
        return t.dtype if isinstance(t, torch.Tensor) else None
    if n.op == "placeholder":
        return getattr(paint.meta_val(n), "dtype", None)
    return None


def rewrite(
    gm: fx.GraphModule,
    dtype: torch.dtype,
    *,
    lists: paint.Lists | None = None,
    fp32_inside: bool = False,
    ops: Mapping[Any, str | None] | None = None,
    fp32_modules: Iterable[str] = (),
    output_dtype: torch.dtype | None = torch.float32,
    kernels: str = "torch",
) -> PassResult:
    """Colour ``gm`` for ``dtype`` and rewrite it in place (see :mod:`mixprec.graph.paint`).

    Args:
        gm: an FX graph module whose nodes carry dtype metadata.
        dtype: the 16-bit compute dtype.
        lists: the op lists (default: built from the current cast table, ``fp32_inside``, ``ops``).
        fp32_modules: module paths whose ops stay float32.
        output_dtype: dtype of the graph's floating outputs (None: as traced).
        kernels: ``"auto"`` swaps in mixprec's faster kernels (eager's rule); ``"torch"`` never.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"The graph pass lowers to float16 or bfloat16, received {dtype}.")
    if kernels not in ("auto", "torch"):
        raise ValueError(f"kernels must be 'auto' or 'torch', received {kernels!r}.")
    lists = lists or paint.build_lists(fp32_inside=fp32_inside, ops=ops)
    low_inputs = [
        n for n in gm.graph.nodes if _stored_dtype(gm, n) in (torch.float16, torch.bfloat16)
    ]
    c = paint.colour(gm.graph, lists, fp32_modules=fp32_modules, low_inputs=low_inputs)
    rw = casts.apply(gm, c, dtype, output_dtype=output_dtype)
    if kernels == "auto":
        for n in gm.graph.nodes:
            if (
                n in c.allow
                and paint.node_op(n) == "scaled_dot_product_attention"
                and n.op == "call_function"
            ):
                n.target = auto_attention
        gm.recompile()
    return PassResult(c, rw, dtype, gm.graph)
