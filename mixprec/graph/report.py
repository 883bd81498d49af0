"""The precision report: what the graph pass chose for every node, why, and what it cost.

Grappler's weak spot (TensorFlow's ``auto_mixed_precision``) is that users cannot see which parts of
the model ran in which dtype without VLOG dumps. Here the same facts are data: one row per op node
(dtype, list, reason, module path), every cast with its size, grappler's summary line, and the bytes
the ops write in 16-bit vs 32-bit. Print it for a terminal table, or ``to_dict()`` / ``to_json()``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx

from mixprec.graph import paint
from mixprec.graph.casts import numel
from mixprec.graph.rewrite import auto_attention

__all__ = ["NodeRow", "PrecisionReport"]


def _short(dtype: torch.dtype | None) -> str:
    return {
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float64: "fp64",
        None: "-",
    }.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class NodeRow:
    """One op node of the rewritten graph."""

    name: str
    op: str
    module: str
    list: str  # allow / deny / infer / clear, or "fixed"
    dtype: str
    reason: str
    bytes: int


@dataclass
class PrecisionReport:
    """Per-node decisions, casts and traffic of one rewritten graph."""

    dtype: str
    nodes: list[NodeRow]
    casts: list[dict[str, Any]]
    summary: str
    bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, gm: fx.GraphModule, result: Any) -> PrecisionReport:
        c, rw, low = result.colouring, result.rewrite, result.dtype
        rows = []
        for n in gm.graph.nodes:
            if n.op not in ("call_function", "call_method"):
                continue
            op = paint.node_op(n) or str(n.target)
            if n.target is auto_attention:
                op = "scaled_dot_product_attention"  # with mixprec's faster CPU kernel
            if op == "cast_to" and n not in c.kind and n not in c.fixed:
                continue  # a cast the pass inserted: listed under casts
            dt = rw.dtypes.get(n.name)
            v = paint.meta_val(n)
            size = 0 if paint.is_multi(v) or dt is None else numel(v) * dt.itemsize
            if n in c.kind:
                kind, why = c.kind[n], c.reason.get(n, "")
            else:
                kind, why = "fixed", c.fixed.get(n, "")
            rows.append(NodeRow(n.name, op, paint._module_path(n), kind, _short(dt), why, size))
        casts = [
            dict(
                producer=k.producer,
                src=_short(k.src),
                dst=_short(k.dst),
                kind=k.kind,
                consumers=k.consumers,
                bytes=k.numel * k.dst.itemsize,
            )
            for k in rw.casts
        ]
        considered = len(c.kind)
        lowered = len(c.allow)
        runtime = rw.count("activation", "input")
        summary = (
            f"Converted {lowered}/{considered} nodes to {str(low)[6:]} using {runtime} "
            f"cast(s) (excluding {rw.count('weight')} weight cast(s); {rw.count('folded')} "
            f"constant(s) folded; {rw.count('retargeted')} existing cast(s) retargeted, "
            f"{rw.count('removed')} removed; {rw.count('implicit')} left to type promotion)"
        )
        traffic: Counter[str] = Counter({"16-bit": 0, "32-bit": 0})
        fp32_graph = 0
        for r in rows:
            if r.bytes:
                traffic["16-bit" if r.dtype in ("bf16", "fp16") else "32-bit"] += r.bytes
                fp32_graph += r.bytes * (2 if r.dtype in ("bf16", "fp16") else 1)
        traffic["float32 graph"] = fp32_graph
        return cls(_short(low), rows, casts, summary, dict(traffic))

    # -- views -------------------------------------------------------------------------------
    def by_op(self) -> dict[str, dict[str, int]]:
        """``{op: {dtype: count}}`` over the op nodes."""
        out: dict[str, Counter[str]] = defaultdict(Counter)
        for r in self.nodes:
            out[r.op][r.dtype] += 1
        return {k: dict(v) for k, v in sorted(out.items())}

    def by_module(self) -> dict[str, dict[str, int]]:
        """``{module path: {dtype: count}}`` over the op nodes."""
        out: dict[str, Counter[str]] = defaultdict(Counter)
        for r in self.nodes:
            out[r.module or "<root>"][r.dtype] += 1
        return {k: dict(v) for k, v in sorted(out.items())}

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "summary": self.summary,
            "bytes": self.bytes,
            "by_op": self.by_op(),
            "by_module": self.by_module(),
            "nodes": [asdict(r) for r in self.nodes],
            "casts": self.casts,
        }

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def table(self, detail: bool = False) -> str:
        """A plain-text table: per op type (default) or per node (``detail=True``)."""
        if detail:
            head = ["node", "op", "module", "list", "dtype", "reason"]
            body = [[r.name, r.op, r.module, r.list, r.dtype, r.reason] for r in self.nodes]
        else:
            head = ["op", "list", "dtype", "count", "why (first node)"]
            groups: dict[tuple[str, str, str], list[NodeRow]] = defaultdict(list)
            for r in self.nodes:
                groups[(r.op, r.list, r.dtype)].append(r)
            body = [
                [op, kind, dt, str(len(rs)), rs[0].reason]
                for (op, kind, dt), rs in sorted(groups.items())
            ]
        widths = [
            max(len(h), *(len(row[i]) for row in body)) if body else len(h)
            for i, h in enumerate(head)
        ]
        widths[-1] = min(widths[-1], 70)
        lines = [
            "  ".join(h.ljust(w) for h, w in zip(head, widths)),
            "  ".join("-" * w for w in widths),
        ]
        lines += ["  ".join(c[:w].ljust(w) for c, w in zip(row, widths)) for row in body]
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        mb = {k: v / 2**20 for k, v in self.bytes.items()}
        traffic = (
            f"Bytes written by ops per call: {mb.get('16-bit', 0):.2f} MiB in 16-bit, "
            f"{mb.get('32-bit', 0):.2f} MiB in 32-bit (float32 graph: "
            f"{mb.get('float32 graph', 0):.2f} MiB)"
        )
        return f"{self.summary}\n{traffic}\n\n{self.table()}"
