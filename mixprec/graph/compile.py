"""The compiler path: the graph pass inside ``torch.compile``, before inductor.

Design: dynamo hands a backend the *forward* FX graph at the torch level (``F.linear``,
``operator.add``, methods), with fake-tensor metadata. The pass colours and rewrites that graph
-- ops are named through the same cast table, so nothing here is specific to ATen -- and then
gives it to inductor. AOTAutograd derives the backward graph from the rewritten forward, so the
backward runs in the matching dtypes, and inductor fuses the casts into the neighbouring
pointwise kernels (a cast then costs no memory pass of its own). This is PAI-TAO's "1+1>2":
the pass decides precision, the compiler removes its cost.

Use ``torch.compile(model, backend=mixprec.graph.backend())`` or :func:`compile`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import fx, nn

from mixprec.graph.caches import has_cache_switch
from mixprec.graph.convert import GRAPH_ATTR

__all__ = ["backend", "compile"]


def backend(
    recipe: Any = None,
    *,
    compiler: str = "inductor",
    ops: Mapping[Any, str | None] | None = None,
    fp32_modules: Iterable[str] = (),
) -> Callable[[fx.GraphModule, list], Callable]:
    """A ``torch.compile`` backend that runs the graph pass, then ``compiler``.

    Args:
        recipe: as in :func:`mixprec.convert`: a Recipe, or a policy (default: the global policy
            if mixed, else the fast 16-bit dtype here). ``kernels`` is the recipe's, ``"auto"``
            with a policy, as in ``convert``: inductor runs attention as an extern kernel, so
            the decomposed attention that ``"auto"`` picks where it is measured faster stays
            faster compiled (``docs/graph.md``).
        compiler: ``"inductor"`` (fuses the casts); ``"aot_eager"`` (AOTAutograd traces
            forward and backward, no code generation) or ``"eager"`` (the rewritten graph as
            is) to debug the pass under dynamo.
        ops, fp32_modules: as in ``convert``.
    """
    from mixprec.graph.convert import graph_settings
    from mixprec.graph.rewrite import rewrite

    if compiler not in ("inductor", "aot_eager", "eager"):
        raise ValueError(
            f"compiler must be 'inductor', 'aot_eager' or 'eager', received {compiler!r}."
        )
    pol, settings = graph_settings(recipe)
    options = {**settings, "ops": dict(ops or {}), "fp32_modules": tuple(fp32_modules)}
    results: list[Any] = []

    def mixprec_backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        _drop_enabled_autocast(gm)
        results.append(rewrite(gm, pol.compute_dtype, output_dtype=pol.output_dtype, **options))
        if compiler == "eager":
            return gm.forward
        if compiler == "aot_eager":
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    mixprec_backend.results = results  # type: ignore[attr-defined]  # one PassResult per graph
    return mixprec_backend


def _low_storage(model: nn.Module) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the model's first 16-bit parameter, or None."""
    for p in model.parameters():
        if p.dtype in (torch.bfloat16, torch.float16):
            return p.device.type, p.dtype
    return None


def _is_autocast(n: fx.Node, name: str) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == name


def _drop_enabled_autocast(gm: fx.GraphModule) -> None:
    """Remove the autocast regions that *enable* autocast from a dynamo graph.

    The pass takes autocast's place: it decides the dtypes there. Regions that disable autocast
    stay, and :mod:`mixprec.graph.paint` keeps their ops float32, as the model asked.
    """
    changed = False
    for n in list(gm.graph.nodes):
        if not _is_autocast(n, "_enter_autocast"):
            continue
        enabled = n.args[2] if len(n.args) > 2 else n.kwargs.get("enabled", True)
        if not enabled:
            continue
        for u in list(n.users):
            if not _is_autocast(u, "_exit_autocast") or u.users:
                raise AssertionError(f"unexpected reader {u.format_node()} of {n.name}")
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()


class _Compiled(nn.Module):
    """``model`` behind its own compiled entry function (state dict keys as torch.compile's)."""

    def __init__(self, model: nn.Module, entry: Callable) -> None:
        super().__init__()
        self._orig_mod = model
        self.__dict__["_entry"] = entry

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._entry(*args, **kwargs)


_entries = itertools.count()


def compile(
    model: nn.Module,
    recipe: Any = None,
    *,
    compiler: str = "inductor",
    ops: Mapping[Any, str | None] | None = None,
    fp32_modules: Iterable[str] = (),
) -> nn.Module:
    """``torch.compile(model, backend=backend(recipe, ...))``, marked as graph-converted.

    The mark tells :func:`mixprec.initialize` that the casts live in the graph: it then stores
    weights and wraps the optimizer for the level, without installing the eager engine.

    Once weights are stored in 16-bit (O2, O3) the model is traced under ``torch.autocast``:
    its own code can mix dtypes that only a cast policy reconciles (T5's float32 norms feed
    16-bit projections, and a 16-bit position bias meets the float32 query in attention), and
    dynamo checks each op on fake tensors as it traces. The backend removes that autocast
    region before the pass, which then decides every dtype itself.

    A Hugging Face model is called with ``use_cache=False`` unless the call passes
    ``use_cache``: its key/value cache would be graph outputs, cast to the output dtype and kept
    alive, which training does not use (:mod:`mixprec.graph.caches`).

    Each call compiles its own entry function: dynamo caches compiled code per code object,
    and a plain ``torch.compile(model)`` shares ``Module.__call__``'s with every model of the
    process -- after a few models its recompile limit sends the rest to eager mode, where
    16-bit weights without the pass's casts fail.
    """

    no_cache = has_cache_switch(model)

    def entry(*args: Any, **kwargs: Any) -> Any:
        if no_cache and "use_cache" not in kwargs:  # a training graph returns no kv cache
            kwargs = {**kwargs, "use_cache": False}
        stored = _low_storage(model)  # read while dynamo traces; it guards on the dtypes
        if stored is None:
            return model(*args, **kwargs)
        with torch.autocast(stored[0], dtype=stored[1]):  # removed again by the backend
            return model(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"mixprec_graph_entry_{next(_entries)}")
    compiled = _Compiled(
        model,
        torch.compile(
            entry,
            backend=backend(recipe, compiler=compiler, ops=ops, fp32_modules=fp32_modules),
        ),
    )
    model.__dict__[GRAPH_ATTR] = True
    compiled.__dict__[GRAPH_ATTR] = True
    return compiled
