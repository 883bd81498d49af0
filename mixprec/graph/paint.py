"""Colour an FX graph grappler-style: which nodes run in 16-bit, which stay float32, and why.

Design (TensorFlow's ``auto_mixed_precision``; ``docs/design.md``, "The graph pass"):

* The four lists come from :mod:`mixprec._core.cast_table`, the same data the eager engine reads:
  ``lower`` ops are the **allow** list, ``fp32`` ops the **deny** list, ``promote`` ops and
  :data:`~mixprec._core.cast_table.GRAPH_INFER` the **infer** list, and
  :data:`~mixprec._core.cast_table.GRAPH_CLEAR` the **clear** list. With ``fp32_inside`` the ops
  whose 16-bit kernels accumulate in float32 (layer norm, softmax) move from deny to infer, as in
  eager. An op in no list is a float32 boundary (grappler's rule for unknown ops).
* A node is *processable* when its output is a float32 tensor (or a tuple of them, read through
  ``getitem``), it mutates nothing, has no explicit ``dtype=`` and is not under a module forced to
  float32. Placeholders, parameters, constants and the graph outputs keep their dtype.
* A node's colour must be a dtype it can actually produce, since the casts are placed from the
  colours. So three more kinds of node keep their traced dtype: a ``getitem`` reading a node the
  pass does not colour (torch.export turns a ``torch.autocast(enabled=False)`` or ``no_grad``
  region, such as RoPE's cos/sin, into one such node), an op with no floating input to cast, and
  an op inside a region where the model disables autocast (dynamo inlines those regions; the
  model asked for float32 there, as torch.autocast would give it).
* The passes are grappler's, in its order: paint allow ops; propagate deny forwards through the
  clear/infer chains that lead into another infer or deny op; paint allow the infer and clear
  nodes sandwiched between allow nodes; spread allow through clear runs in both directions;
  give a multi-output node and its ``getitem`` readers one colour (a ``getitem`` on a tensor,
  dynamo's ``x[:, -k:]``, is a clear op of its own, not such a reader).

The graph is any ``torch.fx`` graph whose nodes carry dtype metadata (``meta["val"]`` from
torch.export / dynamo, or ``meta["tensor_meta"]`` from ``ShapeProp``), at the ATen level or the
torch level: ops are named by :func:`mixprec._core.cast_table.op_name` in both.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from mixprec._core.cast_table import (
    CAST_OPS,
    FP32,
    FP32_INSIDE_OPS,
    GRAPH_CLEAR,
    GRAPH_INFER,
    LOWER,
    PROMOTE,
    SOURCE_OPS,
    current_table,
    op_name,
)

__all__ = [
    "ALLOW",
    "CLEAR",
    "DENY",
    "INFER",
    "LISTS",
    "Colouring",
    "Lists",
    "build_lists",
    "colour",
    "is_multi",
    "meta_val",
    "mutates",
    "node_op",
]

ALLOW, DENY, INFER, CLEAR = "allow", "deny", "infer", "clear"
LISTS = (ALLOW, DENY, INFER, CLEAR)


@dataclass(frozen=True)
class Lists:
    """Grappler's four op lists, as sets of base op names. An op is in at most one list."""

    allow: frozenset[str]
    deny: frozenset[str]
    infer: frozenset[str]
    clear: frozenset[str]

    def of(self, name: str) -> str | None:
        for kind in LISTS:
            if name in getattr(self, kind):
                return kind
        return None


def build_lists(
    table: Mapping[str, str] | None = None,
    *,
    fp32_inside: bool = False,
    ops: Mapping[Any, str | None] | None = None,
) -> Lists:
    """The lists from the cast table (default: the current one) plus convert-time overrides.

    ``ops`` moves ops between lists: ``{"gelu": "deny", torch.softmax: "infer", "mm": None}``
    (``None``: in no list, so a float32 boundary). Keys are any op spelling.
    """
    table = current_table() if table is None else table
    sets: dict[str, set[str]] = {k: set() for k in LISTS}
    for name, rule in table.items():
        kind = {LOWER: ALLOW, FP32: DENY, PROMOTE: INFER}[rule]
        if fp32_inside and name in FP32_INSIDE_OPS and kind == DENY:
            kind = INFER
        sets[kind].add(name)
    placed = set().union(*sets.values())
    sets[INFER] |= GRAPH_INFER - placed
    sets[CLEAR] |= GRAPH_CLEAR - placed - sets[INFER]
    for op, kind in (ops or {}).items():
        name = op_name(op)[0]
        if kind is not None and kind not in LISTS:
            raise ValueError(
                f"Unknown list {kind!r} for op {name!r}: expected one of {LISTS} "
                "or None (a float32 boundary)."
            )
        for s in sets.values():
            s.discard(name)
        if kind is not None:
            sets[kind].add(name)
    return Lists(*(frozenset(sets[k]) for k in LISTS))


def meta_val(node: Any) -> Any:
    """The example value (fake tensor, tuple, or TensorMetadata) recorded on a node, or None."""
    if not isinstance(node, fx.Node):
        return None
    for key in ("val", "example_value", "tensor_meta"):
        v = node.meta.get(key)
        if v is not None:
            return v
    return None


def is_multi(v: Any) -> bool:
    """True for a tuple/list of example values (not ShapeProp's TensorMetadata namedtuple)."""
    return isinstance(v, (tuple, list)) and not isinstance(v, TensorMetadata)


def _dtype_of(v: Any) -> torch.dtype | None:
    dt = getattr(v, "dtype", None)
    return dt if isinstance(dt, torch.dtype) else None


def node_op(node: fx.Node) -> str | None:
    """The base op name of a call node (``aten.linear.default`` and ``F.linear``: "linear")."""
    if node.op == "call_method":
        return op_name(str(node.target))[0]
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return "getitem"
    try:
        name, inplace = op_name(node.target)
    except TypeError:
        return None
    return name + "_" if inplace else name


def mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = node_op(node) or ""
    return (name.endswith("_") and not name.startswith("_")) or "out" in node.kwargs


@dataclass
class Colouring:
    """The result of :func:`colour`: per node, its list, colour and the reason for the colour."""

    lists: Lists
    kind: dict[fx.Node, str | None] = field(default_factory=dict)  # list of each processable node
    allow: set[fx.Node] = field(default_factory=set)
    deny: set[fx.Node] = field(default_factory=set)
    reason: dict[fx.Node, str] = field(default_factory=dict)
    fixed: dict[fx.Node, str] = field(default_factory=dict)  # unprocessable call nodes: why

    def processable(self, node: fx.Node) -> bool:
        return node in self.kind

    def is_low(self, node: fx.Node) -> bool:
        return node in self.allow


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path).replace("L['self'].", "").replace("L__self__.", "")


def _forced_fp32(node: fx.Node, prefixes: tuple[str, ...]) -> bool:
    if not prefixes:
        return False
    path = _module_path(node)
    return any(path == p or path.startswith(p + ".") for p in prefixes)


COLOURABLE = (torch.float32, torch.bfloat16, torch.float16)


def _float_out(node: fx.Node) -> bool:
    """True when the node's output is a float32/16-bit tensor, or a tuple/list with one.

    16-bit outputs occur when the graph was traced with 16-bit weights (dynamo after O2); they
    are coloured like float32 ones, so the table's fp32 ops still get float32.
    """
    v = meta_val(node)
    if is_multi(v):
        return any(_dtype_of(x) in COLOURABLE for x in v)
    return _dtype_of(v) in COLOURABLE


def _classify(
    node: fx.Node,
    lists: Lists,
    fp32_modules: tuple[str, ...],
    low_inputs: frozenset[fx.Node],
    kinds: Mapping[fx.Node, str | None],
    no_autocast: frozenset[fx.Node],
) -> tuple[str | None, str]:
    name = node_op(node)
    if name is None:
        return None, "not an op"
    if name in CAST_OPS:
        return None, "existing cast"
    src = node.args[0] if name == "getitem" and node.args else None
    if isinstance(src, fx.Node) and is_multi(meta_val(src)) and src not in kinds:
        # a read of one output of a node the pass does not recolour (a boundary, or a captured
        # region such as torch.export's wrap_with_autocast): a getitem cannot change a dtype,
        # so it has its producer's; readers that need another get a cast after it
        return None, f"reads an output of {src.name} ({node_op(src) or src.op}), a fixed node"
    if name in SOURCE_OPS:
        if node.args and node.args[0] in low_inputs and _float_out(node):
            return ALLOW, ""  # a 16-bit table: its rows come out 16-bit, a source of allow
        return None, "gathers from its table in the table's dtype; cast after it"
    if mutates(node):
        return None, "mutates an input"
    if node.kwargs.get("dtype") is not None:
        return None, "explicit dtype="
    if not _float_out(node):
        return None, "no float32 output"
    if _forced_fp32(node, fp32_modules):
        return None, f"module {_module_path(node)!r} forced to float32"
    if node in no_autocast:
        return None, "the model disabled autocast here (torch.autocast(enabled=False))"
    kind = lists.of(name)
    if kind is None:
        return None, f"op {name!r} is in no list: a float32 boundary"
    if not any(True for _ in _float_edges(node)):
        # a factory (torch.full, torch.rand): no floating input to cast, so it keeps its dtype
        return None, "no floating input: keeps the dtype it was traced with"
    return kind, ""


def _autocast_disabled(graph: fx.Graph) -> frozenset[fx.Node]:
    """Nodes inside ``torch.autocast(..., enabled=False)`` regions of a dynamo graph.

    dynamo inlines such a region between ``_enter_autocast`` and ``_exit_autocast`` nodes (the
    third argument of the enter node is ``enabled``). torch.export keeps the region as one
    ``wrap_with_autocast`` node instead, which is a boundary already. A model disables autocast
    where it wants float32 (rotary embeddings, a loss), so the pass keeps those ops float32 too.
    """
    inside: set[fx.Node] = set()
    stack: list[bool] = []  # enabled flag of each open region
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "")
        if n.op == "call_function" and name == "_enter_autocast":
            enabled = n.args[2] if len(n.args) > 2 else n.kwargs.get("enabled", True)
            stack.append(bool(enabled))
        elif n.op == "call_function" and name == "_exit_autocast":
            if stack:
                stack.pop()
        elif stack and not stack[-1]:
            inside.add(n)
    return frozenset(inside)


def _float_edges(node: fx.Node) -> Iterable[fx.Node]:
    return (n for n in node.all_input_nodes if _carries_float(n))


def _carries_float(node: fx.Node) -> bool:
    v = meta_val(node)
    if is_multi(v):
        return any(_dtype_of(x) is not None and _dtype_of(x).is_floating_point for x in v)
    dt = _dtype_of(v)
    return dt is not None and dt.is_floating_point


def colour(
    graph: fx.Graph,
    lists: Lists,
    *,
    fp32_modules: Iterable[str] = (),
    low_inputs: Iterable[fx.Node] = (),
) -> Colouring:
    """Run grappler's painting passes on ``graph``; the graph itself is not changed.

    ``low_inputs``: placeholder/get_attr nodes that hold 16-bit tensors (weights stored in
    16-bit); an embedding gathering from one of them is an allow node.
    """
    c = Colouring(lists)
    prefixes = tuple(p.strip(".") for p in fp32_modules)
    low = frozenset(low_inputs)
    no_autocast = _autocast_disabled(graph)
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        kind, why = _classify(node, lists, prefixes, low, c.kind, no_autocast)
        if kind is None:
            c.fixed[node] = why
        else:
            c.kind[node] = kind
    fanin = {n: [p for p in _float_edges(n) if p in c.kind] for n in c.kind}
    fanout: dict[fx.Node, list[fx.Node]] = {n: [] for n in c.kind}
    for n, ins in fanin.items():
        for p in ins:
            fanout[p].append(n)
    _paint_allow(c)
    _paint_deny(c, fanin, fanout)
    _paint_between_allow(c, fanin, fanout)
    _paint_clear_runs(c, fanin, fanout)
    _paint_multi_outputs(c)
    for n, kind in c.kind.items():
        if n not in c.allow and n not in c.reason:
            c.reason[n] = (
                f"{kind} op not between allow ops" if kind in (INFER, CLEAR) else f"{kind} op"
            )
    return c


_Edges = dict[fx.Node, list[fx.Node]]


def _paint_allow(c: Colouring) -> None:
    """Pass 1: allow ops."""
    for n, kind in c.kind.items():
        if kind == ALLOW:
            c.allow.add(n)
            c.reason[n] = (
                f"{node_op(n)} gathers from a 16-bit table"
                if node_op(n) in SOURCE_OPS
                else f"{node_op(n)} is on the allow list (cast table: lower)"
            )


def _paint_deny(c: Colouring, fanin: _Edges, fanout: _Edges) -> None:
    """Pass 2: deny propagates forwards through clear/infer chains that lead into infer or
    deny."""
    upstream: set[fx.Node] = set()
    for n, kind in c.kind.items():
        if kind in (DENY, INFER):
            upstream.add(n)
            _walk(n, fanin, lambda m: c.kind[m] == CLEAR, upstream)
    for n, kind in c.kind.items():
        if kind == DENY:
            c.deny.add(n)
            c.reason[n] = f"{node_op(n)} is on the deny list (cast table: fp32)"
    for n in [n for n, k in c.kind.items() if k == DENY]:
        reached: set[fx.Node] = set()
        _walk(n, fanout, lambda m: m in upstream and c.kind[m] != DENY, reached)
        for m in reached - c.deny:
            c.deny.add(m)
            c.reason[m] = f"deny propagates from {n.name} ({node_op(n)}) through clear/infer ops"


def _paint_between_allow(c: Colouring, fanin: _Edges, fanout: _Edges) -> None:
    """Pass 3: infer/clear nodes between two allow nodes become allow."""

    def between(m: fx.Node) -> bool:
        return c.kind[m] in (INFER, CLEAR) and m not in c.deny and m not in c.allow

    downstream: set[fx.Node] = set()
    for n in list(c.allow):
        _walk(n, fanout, between, downstream)
    for n in list(c.allow):
        reached: set[fx.Node] = set()
        _walk(n, fanin, lambda m: m in downstream, reached)
        for m in reached - c.allow:
            c.allow.add(m)
            c.reason[m] = f"{c.kind[m]} op between allow ops (reaches {n.name})"


def _paint_clear_runs(c: Colouring, fanin: _Edges, fanout: _Edges) -> None:
    """Pass 4: clear runs take the allow colour in both directions."""
    both = {n: fanin[n] + fanout[n] for n in c.kind}
    for n in list(c.allow):
        reached: set[fx.Node] = set()
        _walk(n, both, lambda m: c.kind[m] == CLEAR and m not in c.deny, reached)
        for m in reached - c.allow:
            c.allow.add(m)
            c.reason[m] = f"clear op next to allow op {n.name}"


def _paint_multi_outputs(c: Colouring) -> None:
    """Pass 5: a multi-output node and its getitem readers share one colour."""
    for n in c.kind:
        if not is_multi(meta_val(n)):
            continue  # a getitem on a tensor (dynamo's x[..., :k]) is a clear op of its own
        readers = [u for u in n.users if u.target is operator.getitem and u in c.kind]
        if not readers:
            continue
        group = [n, *readers]
        if any(m in c.deny for m in group) or not any(m in c.allow for m in group):
            for m in group:
                if m in c.allow:
                    c.allow.discard(m)
                    c.reason[m] = f"matches the float32 colour of {n.name}'s outputs"
        else:
            for m in group:
                if m not in c.allow:
                    c.allow.add(m)
                    c.reason[m] = f"matches the 16-bit colour of {n.name}'s outputs"


def _walk(
    start: fx.Node, edges: Mapping[fx.Node, list[fx.Node]], ok: Any, seen: set[fx.Node]
) -> None:
    """Depth-first from ``start`` along ``edges`` through nodes that satisfy ``ok``."""
    stack = [start]
    while stack:
        n = stack.pop()
        for m in edges.get(n, ()):
            if m not in seen and ok(m):
                seen.add(m)
                stack.append(m)
