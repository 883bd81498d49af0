"""Op statistics: how many ops ran in fp32, bf16, fp16 or other dtypes, per op, over a region.

``with mixprec.numerics.op_stats() as stats: ...`` then ``print(stats.table())`` or
``stats.as_dict()``.

Design (Paddle's ``collect_operator_stats``; ``docs/design.md``, "Numerics tools"):

* Counted at the aten level with a ``TorchDispatchMode``: these are the kernels that actually
  ran -- after torch.autocast and mixprec's cast table, after composite ops such as ``linear``
  decomposed into ``t`` + ``addmm``, and in backward too. Counting Python-level calls instead
  would miss the backward and report what was asked for rather than what ran.
* An op's dtype is the dtype of its first floating-point output, or, when it returns no
  floating tensor (comparisons, ``_local_scalar_dense``), of its first floating input; ops with
  neither, and float64, count as ``other``. Casts (``_to_copy``) therefore count under the dtype
  they cast *to*, so the ``_to_copy`` row shows the cast traffic a policy costs (as Paddle's
  ``transfer_dtype`` row does).
* ``fp8``: an op with an FP8 operand or result -- the scaled matmuls of FP8 layers
  (``_scaled_mm``, whose output is 16-bit, counts here), the casts into FP8 and back.
* Forward and backward are counted separately (``phase``) and merged by default.

Counting never changes numerics; it costs one Python call per aten op (measured in
``docs/numerics.md``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.numerics.nonfinite_ops import iter_tensors

__all__ = ["CATEGORIES", "OpStats", "op_stats"]

CATEGORIES = ("fp32", "bf16", "fp16", "fp8", "other")
_CAT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8 = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)
_PHASES = ("forward", "backward")


def op_dtype_category(out: Any, args: Any) -> str:
    """The category an op is counted under (see the module docstring)."""
    for source in (out, args):
        if any(t.dtype in _FP8 for t in iter_tensors(source)):
            return "fp8"
    for source in (out, args):
        for t in iter_tensors(source):
            if t.is_floating_point():
                return _CAT.get(t.dtype, "other")
    return "other"


class OpStats(TorchDispatchMode):
    """Counts aten ops per (phase, op name, dtype category) while active.

    Op names are aten overload packets (``"addmm"``, ``"_to_copy"``, ``"native_layer_norm"``).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # An eager diagnostic: do not wrap __torch_dispatch__ in dynamo.disable (that costs a
        # one-time torch._dynamo import of several seconds and a wrapper call per op).
        return False

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
        self.counts[(phase, func.overloadpacket.__name__, op_dtype_category(out, args))] += 1
        return out

    def reset(self) -> None:
        self.counts.clear()

    def as_dict(self, phase: str | None = None) -> dict[str, dict[str, int]]:
        """``{op: {"fp32": n, "bf16": n, "fp16": n, "fp8": n, "other": n}}``, sorted by op name.

        Args:
            phase: ``"forward"``, ``"backward"`` or None (both).
        """
        if phase not in (None, *_PHASES):
            raise ValueError(f"phase={phase!r} is not one of {(None, *_PHASES)}.")
        out: dict[str, dict[str, int]] = {}
        for (ph, op, cat), n in self.counts.items():
            if phase is None or ph == phase:
                row = out.setdefault(op, dict.fromkeys(CATEGORIES, 0))
                row[cat] += n
        return dict(sorted(out.items()))

    def totals(self, phase: str | None = None) -> dict[str, int]:
        """Ops per dtype category, summed over op names."""
        tot = dict.fromkeys(CATEGORIES, 0)
        for row in self.as_dict(phase).values():
            for cat, n in row.items():
                tot[cat] += n
        return tot

    def table(self, phase: str | None = None) -> str:
        """A fixed-width table: ``op | fp32 | bf16 | fp16 | fp8 | other | total``, then totals."""
        rows = [
            [op, *(str(r[c]) for c in CATEGORIES), str(sum(r.values()))]
            for op, r in self.as_dict(phase).items()
        ]
        tot = self.totals(phase)
        rows.append(["TOTAL", *(str(tot[c]) for c in CATEGORIES), str(sum(tot.values()))])
        headers = ["op", *CATEGORIES, "total"]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = [
            "  ".join(
                h.ljust(w) if i == 0 else h.rjust(w)
                for i, (h, w) in enumerate(zip(headers, widths))
            )
        ]
        lines.append("  ".join("-" * w for w in widths))
        for r in rows:
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                )
            )
        return "\n".join(lines)


def op_stats() -> OpStats:
    """Context manager counting the ops that run inside it, per dtype (forward and backward).

    Example::

        with mixprec.numerics.op_stats() as stats:
            with mixprec.autocast(torch.bfloat16):
                loss = model(x).float().sum()
            loss.backward()
        print(stats.table())
    """
    return OpStats()
