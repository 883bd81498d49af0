"""Rewrite a coloured FX graph: insert the fewest casts, retarget or remove the existing ones.

Design (grappler's ``ChangeTypeAttrsAndAddCasts`` and ``MakeCastsAllowIfAllOutputsAllow``,
plus three removals grappler leaves out; ``docs/design.md``, "The graph pass"):

* An ATen op computes in the dtype of its inputs, so colouring a node 16-bit means giving it
  16-bit inputs. Every producer whose dtype differs from what a consumer needs gets **one** cast
  per target dtype, shared by all consumers that need it.
* Every floating input of an allow op gets the op's dtype, 0-dim ones included: matmul,
  convolution and attention kernels take no mix (a 0-dim float32 ``input`` of a bf16 ``addmm``
  fails). :func:`apply` checks this after placing the casts (:func:`mixed_allow_inputs`), from
  the dtype each node really produces: its colour, its cast target, its traced dtype when it is
  fixed, the dtype of the tensor it writes when it works in place.
* Existing float casts in the model (``x.float()``, ``.to(dtype)``): a cast to float32 whose
  readers all run in 16-bit is retargeted to 16-bit; a cast that no longer changes the dtype is
  removed. A cast's own input is never cast (no cast pairs).
* Casts of constants are folded: a buffer that needs no gradient and is never mutated is cast
  once, here, and stored; 0-dim tensors are not cast for any other op (type promotion already
  lets a 16-bit tensor meet a 0-dim float32 one in 16-bit). Parameters are cast at run time,
  since they train.
* A graph output keeps the dtype the float32 model returned (``output_dtype`` for floats): the
  "float32 outputs" rule of mixed policies.
* A promote-rule op (add, mul, ...) coloured float32 that already has a float32 tensor input
  gets its 16-bit input uncast: type promotion widens it inside the kernel, as torch does.
* Capture-time dtype asserts (``_assert_tensor_metadata``) are dropped: they pin the old dtypes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from mixprec._core.cast_table import CAST_OPS, DROP_OPS, PROMOTE, SOURCE_OPS, current_table
from mixprec.graph.paint import (
    ALLOW,
    COLOURABLE,
    Colouring,
    meta_val,
    mutates,
    node_op,
)

__all__ = ["CastRecord", "Rewrite", "apply", "cast_to", "mixed_allow_inputs"]

# ops that take their first argument as data and keep statistics/affine params in their own
# dtype: always for batch norm (its running statistics are updated in place, so they cannot be
# cast copies); for the layer/group norms when they run on 16-bit data (their kernels take
# 16-bit data with float32 weights, which is what the eager engine passes them)
_DATA_PORT_ONLY = frozenset(
    {
        "batch_norm",
        "instance_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
    }
)
_DATA_PORT_WHEN_LOW = frozenset(
    {"layer_norm", "native_layer_norm", "group_norm", "native_group_norm"}
)


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast the pass inserts: differentiable, and a no-op when ``x`` already has ``dtype``."""
    return x.to(dtype)


@dataclass
class CastRecord:
    """One cast in the rewritten graph."""

    producer: str
    src: torch.dtype
    dst: torch.dtype
    consumers: list[str]
    kind: str  # activation, weight, input, folded, retargeted, removed, implicit (promotion)
    numel: int


@dataclass
class Rewrite:
    """What :func:`apply` did: per-node dtypes and every cast inserted, folded or removed."""

    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    casts: list[CastRecord] = field(default_factory=list)

    def count(self, *kinds: str) -> int:
        return sum(1 for c in self.casts if c.kind in kinds)


def numel(v: Any) -> int:
    """Elements of an example value, with symbolic sizes read at their example hints."""
    shape = getattr(v, "shape", None)
    if shape is None:
        return 0
    total = 1
    for d in shape:
        if isinstance(d, torch.SymInt):
            hint = d.node.hint if hasattr(d.node, "hint") else None
            d = hint if isinstance(hint, int) else 1
        total *= int(d)
    return total


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def _mutated(graph: fx.Graph) -> set[fx.Node]:
    """get_attr nodes that some op writes into."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        for arg, a in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, fx.Node):
                out.add(a)
    return out


def _float_dtype(v: Any) -> torch.dtype | None:
    dt = getattr(v, "dtype", None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def _cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype an existing cast node converts to, or None if it is not a float cast."""
    name = node_op(node)
    if name not in CAST_OPS:
        return None
    fixed = {
        "float": torch.float32,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "double": torch.float64,
    }
    if name in fixed:
        return fixed[name]
    dt = node.kwargs.get("dtype")
    if dt is None:
        dt = next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def apply(
    gm: fx.GraphModule,
    c: Colouring,
    low: torch.dtype,
    *,
    output_dtype: torch.dtype | None = torch.float32,
) -> Rewrite:
    """Insert and remove casts in ``gm`` (in place) so nodes run in the dtypes ``c`` chose."""
    graph = gm.graph
    rw = Rewrite()
    for n in [n for n in graph.nodes if node_op(n) in DROP_OPS and not n.users]:
        graph.erase_node(n)
    written = _mutated(graph)
    dt: dict[fx.Node, torch.dtype | None] = {}
    weights: set[fx.Node] = set()
    for n in graph.nodes:
        dt[n] = _node_dtype(gm, n, c, low, dt, weights)
        rw.dtypes[n.name] = dt[n]
    _tidy_casts(graph, c, low, dt, rw)
    needs = _needs(graph, c, low, dt, output_dtype, rw)
    for p, wants in needs.items():
        for want, readers in wants.items():
            _insert(gm, p, want, readers, dt, weights, written, rw)
    mixed = mixed_allow_inputs(graph, c, dt)
    if mixed:
        raise AssertionError(
            "mixprec graph pass: allow ops would receive floating inputs in different dtypes "
            f"after the rewrite: {mixed[:3]}. Please report this with the model; "
            "ops={name: None} makes such an op a float32 boundary meanwhile."
        )
    graph.lint()
    gm.recompile()
    return rw


def _node_dtype(
    gm: fx.GraphModule,
    n: fx.Node,
    c: Colouring,
    low: torch.dtype,
    dt: dict[fx.Node, torch.dtype | None],
    weights: set[fx.Node],
) -> torch.dtype | None:
    """The float dtype ``n`` produces after the rewrite (None: not a float); trainable
    attributes and lifted parameters are added to ``weights``."""
    v = meta_val(n)
    if n.op == "get_attr":
        t = _attr(gm, n.target)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            weights.add(n)
        return t.dtype if isinstance(t, torch.Tensor) and t.is_floating_point() else None
    if n.op == "placeholder":
        if getattr(v, "requires_grad", False):  # dynamo lifts parameters to inputs
            weights.add(n)
        return _float_dtype(v)
    if c.processable(n):
        return low if c.is_low(n) else torch.float32
    if node_op(n) == "getitem" and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        if c.processable(src) and _float_dtype(v) in COLOURABLE:
            return low if c.is_low(src) else torch.float32
        return _float_dtype(v)
    if node_op(n) in SOURCE_OPS and n.args and isinstance(n.args[0], fx.Node):
        return dt.get(n.args[0]) or _float_dtype(v)
    if _cast_target(n) is not None:
        return _cast_target(n)
    if mutates(n) and n.args and isinstance(n.args[0], fx.Node) and _float_dtype(v):
        return dt.get(n.args[0]) or _float_dtype(v)  # in place: the dtype of what it writes
    return _float_dtype(v)


def _tidy_casts(
    graph: fx.Graph,
    c: Colouring,
    low: torch.dtype,
    dt: dict[fx.Node, torch.dtype | None],
    rw: Rewrite,
) -> None:
    """Existing casts: retarget float32 casts whose readers are all 16-bit, drop no-op casts."""
    for n in list(graph.nodes):
        target = _cast_target(n)
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if target is None or src is None:
            continue
        readers = list(n.users)
        if target == torch.float32 and readers and all(c.is_low(u) for u in readers):
            rw.casts.append(
                CastRecord(
                    n.name,
                    torch.float32,
                    low,
                    [u.name for u in readers],
                    "retargeted",
                    numel(meta_val(n)),
                )
            )
            _retarget(n, low)
            dt[n] = target = low
            rw.dtypes[n.name] = low
        if dt[src] == target:
            rw.casts.append(
                CastRecord(
                    n.name, target, target, [u.name for u in readers], "removed", numel(meta_val(n))
                )
            )
            n.replace_all_uses_with(src)
            graph.erase_node(n)


def _needs(
    graph: fx.Graph,
    c: Colouring,
    low: torch.dtype,
    dt: dict[fx.Node, torch.dtype | None],
    output_dtype: torch.dtype | None,
    rw: Rewrite,
) -> dict[fx.Node, dict[torch.dtype, list[fx.Node]]]:
    """What each reader needs from each float input: ``{input: {dtype: [readers]}}``."""
    needs: dict[fx.Node, dict[torch.dtype, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
    for n in graph.nodes:
        if n.op == "output":
            for p in n.all_input_nodes:
                want = _output_want(p, dt, output_dtype)
                if want is not None and dt.get(p) != want:
                    needs[p][want].append(n)
            continue
        if n.op not in ("call_function", "call_method") or _cast_target(n) is not None:
            continue
        for i, p in enumerate(_tensor_args(n)):
            have = dt.get(p)
            if have is None:
                continue
            want = _reader_want(n, i, p, have, c, low, dt, rw)
            if want is not None and have != want:
                needs[p][want].append(n)
    return needs


def _reader_want(
    n: fx.Node,
    i: int,
    p: fx.Node,
    have: torch.dtype,
    c: Colouring,
    low: torch.dtype,
    dt: dict[fx.Node, torch.dtype | None],
    rw: Rewrite,
) -> torch.dtype | None:
    """The dtype reader ``n`` needs its ``i``-th tensor input ``p`` in (None: as it is). An
    input that type promotion widens on the fly is recorded as an ``implicit`` cast instead."""
    name = node_op(n)
    if c.processable(n):
        if i > 0 and (
            name in _DATA_PORT_ONLY or (name in _DATA_PORT_WHEN_LOW and c.is_low(n) and _on_cpu(n))
        ):
            return None
        if c.kind[n] != ALLOW and _is_scalar(p) and not all(_is_scalar(q) for q in _tensor_args(n)):
            return None  # type promotion lets a 0-dim tensor meet any float dtype
        want = low if c.is_low(n) else torch.float32
        if want != have and _promotes(n, p, want, dt):
            rw.casts.append(
                CastRecord(p.name, have, want, [n.name], "implicit", numel(meta_val(p)))
            )
            return None
        return want
    if (
        name in SOURCE_OPS
        or name.endswith("_")
        or getattr(getattr(n.target, "_schema", None), "is_mutable", False)
    ):
        return None
    return _float_dtype(meta_val(p))  # a boundary op gets what it was traced with


def mixed_allow_inputs(
    graph: fx.Graph, c: Colouring, dt: dict[fx.Node, torch.dtype | None]
) -> list[tuple[str, dict[str, str]]]:
    """Allow-list nodes whose floating inputs do not all have one dtype: ``(node, {input:
    dtype})``. Empty after :func:`apply`, which checks it: matmul, convolution and attention
    kernels take no mix (and a mix would silently move the op to float32 or fail).

    The norms on the allow list (moved there with ``ops=``) are left out: their kernels take
    16-bit data with float32 weights by design (``_DATA_PORT_WHEN_LOW``).
    """
    out = []
    for n in graph.nodes:
        if c.kind.get(n) != ALLOW or node_op(n) in _DATA_PORT_ONLY | _DATA_PORT_WHEN_LOW:
            continue
        ins = {p.name: dt.get(p) for p in _tensor_args(n) if dt.get(p) is not None}
        if len(set(ins.values())) > 1:
            out.append((n.name, {k: str(v).replace("torch.", "") for k, v in ins.items()}))
    return out


def _promotes(n: fx.Node, p: fx.Node, want: torch.dtype, dt: dict) -> bool:
    """True when ``n`` is a promote-rule op whose other float32 tensor input already makes type
    promotion compute it in ``want`` (float32): the kernel widens ``p`` on the fly, so an explicit
    cast would only add a kernel and a buffer."""
    if want != torch.float32 or current_table().get(node_op(n) or "") != PROMOTE:
        return False
    return any(
        q is not p and dt.get(q) == torch.float32 and not _is_scalar(q) for q in _tensor_args(n)
    )


def _output_want(p: fx.Node, dt: dict, output_dtype: torch.dtype | None) -> torch.dtype | None:
    orig = _float_dtype(meta_val(p))
    if orig is None or dt.get(p) is None:
        return None
    if orig in COLOURABLE and output_dtype is not None:
        return output_dtype
    return orig


def _on_cpu(n: fx.Node) -> bool:
    """True when ``n``'s first input is a CPU tensor: CPU norm kernels take a 16-bit input with
    float32 weights (and keep them exact); CUDA's want one dtype, so there the weights are cast."""
    v = meta_val(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    return getattr(getattr(v, "device", None), "type", "cpu") == "cpu"


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    """Distinct input nodes in argument order."""
    return list(dict.fromkeys(n.all_input_nodes))


def _is_scalar(p: fx.Node) -> bool:
    v = meta_val(p)
    shape = getattr(v, "shape", None)
    return shape is not None and len(shape) == 0


def _retarget(n: fx.Node, low: torch.dtype) -> None:
    name = node_op(n)
    if name in ("float", "half", "bfloat16", "double"):
        n.target = cast_to if n.op == "call_function" else "to"
        n.args = (n.args[0], low)
        return
    if "dtype" in n.kwargs:
        n.kwargs = {**n.kwargs, "dtype": low}
    else:
        n.args = tuple(low if isinstance(a, torch.dtype) else a for a in n.args)


def _insert(
    gm: fx.GraphModule,
    p: fx.Node,
    want: torch.dtype,
    readers: list[fx.Node],
    dt: dict,
    weights: set,
    written: set,
    rw: Rewrite,
) -> None:
    graph = gm.graph
    size = numel(meta_val(p))
    if p.op == "get_attr" and p not in weights and p not in written:
        const = _attr(gm, p.target).detach().to(want)
        name = f"{str(p.target).replace('.', '_')}_mixprec_{str(want).split('.')[-1]}"
        gm.register_buffer(name, const, persistent=False)
        with graph.inserting_after(p):
            new = graph.get_attr(name)
        kind = "folded"
    else:
        anchor = p
        if p.op == "placeholder":  # after all placeholders: they must stay first
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            new = graph.call_function(cast_to, (p, want))
        kind = "weight" if p in weights else "input" if p.op == "placeholder" else "activation"
    v = meta_val(p)
    if v is not None and hasattr(v, "to"):
        with contextlib.suppress(Exception):  # metadata only; the graph is still correct
            new.meta["val"] = v.to(want)
    for r in readers:
        r.replace_input_with(p, new)
    dt[new] = want
    rw.dtypes[new.name] = want
    rw.casts.append(CastRecord(p.name, dt[p], want, [r.name for r in readers], kind, size))
