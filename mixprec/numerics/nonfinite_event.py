"""What :func:`~mixprec.numerics.locate.locate_nonfinite` records: one :class:`NonFiniteEvent`
per step with an inf/NaN, its tensors' :class:`TensorStats`, and the verdict (expected or error).

Design: an event is plain data (``as_dict`` is JSON-ready) with a ``str`` that reads as the
answer; :func:`_classify` holds every rule that decides ``expected`` against ``error`` and the
fix to print, in one place, apart from the hooks that detect the value.

Its public names are listed (``__all__``) and imported from :mod:`mixprec.numerics.locate`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

_LOW = (torch.float16, torch.bfloat16)


@dataclass
class TensorStats:
    """Summary of one floating tensor: dtype, shape, finite min/max/abs-max, non-finite counts."""

    dtype: str
    shape: list[int]
    min: float
    max: float
    absmax: float
    num_nan: int
    num_inf: int

    @classmethod
    @torch.no_grad()
    def of(cls, t: Tensor) -> TensorStats:
        x = t.detach().float()
        finite = torch.isfinite(x)
        vals = x[finite]
        lo, hi = (vals.min().item(), vals.max().item()) if vals.numel() else (math.nan, math.nan)
        return cls(
            str(t.dtype).replace("torch.", ""),
            list(t.shape),
            lo,
            hi,
            max(abs(lo), abs(hi)) if vals.numel() else math.nan,
            int(torch.isnan(x).sum()),
            int(torch.isinf(x).sum()),
        )

    def __str__(self) -> str:
        bad = f", {self.num_nan} nan, {self.num_inf} inf" if self.num_nan or self.num_inf else ""
        return (
            f"{self.dtype}{self.shape} min={self.min:.4g} max={self.max:.4g} "
            f"absmax={self.absmax:.4g}{bad}"
        )


@dataclass
class NonFiniteEvent:
    """The first non-finite value of one step.

    ``severity`` is ``"expected"`` (a 16-bit gradient overflow the loss scaler skips) or
    ``"error"``; ``reason`` says why and what to do.
    """

    step: int
    phase: str  # "forward" or "backward"
    module: str  # dotted path from the watched model ("" is the model itself)
    op: str  # aten op, e.g. "aten.addmm.default"
    node: str | None  # autograd node running the op in backward, e.g. "SqrtBackward0"
    dtype: str
    kind: str  # "inf", "nan" or "inf+nan"
    output: TensorStats
    inputs: list[TensorStats]
    severity: str
    reason: str
    loss_scale: float | None = None
    step_skipped: bool | None = None  # filled in at the next step when an optimizer is watched
    stack: list[str] = field(default_factory=list)
    fp8: str | None = None  # the recipe, when the op ran inside a Linear running in FP8
    fp8_reached: list[str] = field(default_factory=list)  # FP8 layers it reached (forward)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f"module '{self.module or '<model>'}'"
        if self.fp8:
            where += f" (FP8 {self.fp8})"
        node = f" in {self.node}" if self.node else ""
        lines = [
            f"[{self.severity}] step {self.step}, {self.phase}: first {self.kind} in {where},"
            f" op {self.op}{node} ({self.dtype})",
            f"  output: {self.output}",
        ]
        lines += [f"  input {i}: {s}" for i, s in enumerate(self.inputs)]
        if self.fp8_reached:
            lines.append(
                f"  reached FP8 layer(s) {', '.join(self.fp8_reached)}: their casts made the "
                "slice NaN instead of saturating it to a finite 448"
            )
        if self.loss_scale is not None:
            lines.append(f"  loss scale: {self.loss_scale:g}")
        if self.step_skipped is not None:
            lines.append(f"  step skipped by the optimizer: {self.step_skipped}")
        lines.append(f"  {self.reason}")
        return "\n".join(lines)


class NonFiniteError(FloatingPointError):
    """Raised at the op that produced the first inf/NaN when ``raise_on`` asks for it."""

    def __init__(self, event: NonFiniteEvent):
        super().__init__(str(event))
        self.event = event


def _classify(
    phase: str,
    module: str,
    dtype: torch.dtype,
    kind: str,
    inputs: list[TensorStats],
    scale: float | None,
) -> tuple[str, str]:
    where = module or "<model>"
    dname = str(dtype).replace("torch.", "")
    if any(s.num_nan or s.num_inf for s in inputs):
        return "error", (
            "A NaN made from infinite inputs (inf - inf, 0 * inf, a softmax over a "
            "fully masked row): find where the inf came from, or the mask."
        )
    if phase == "backward" and kind == "inf" and dtype in _LOW and scale is not None and scale > 1:
        return "expected", (
            f"A scaled {dname} gradient overflowed at loss scale {scale:g}: the "
            "optimizer skips this step and lowers the scale (dynamic loss "
            "scaling at work)."
        )
    if dtype == torch.float16 and kind == "inf":
        fix = (
            f"the op overflowed float16 (max 65504) from finite inputs: keep '{where}' in "
            f"float32 (mixprec.set_policy(model.get_submodule('{module}'), 'float32'), or "
            "mixprec.numerics.tune), or use bfloat16."
        )
        if phase == "backward":
            fix = "a float16 gradient overflowed without loss scaling to skip it: " + fix
        return "error", fix[0].upper() + fix[1:]
    if dtype in _LOW:
        return "error", (
            f"A {kind} appeared in {dname} from finite inputs; run '{where}' in "
            "float32 (mixprec.set_policy) to see if precision causes it."
        )
    return "error", (
        f"A {kind} appeared in {dname} from finite inputs: a numerical bug (0/0, "
        "inf-inf, log or sqrt of a negative, a zero norm), not a precision issue."
    )
