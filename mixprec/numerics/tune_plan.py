"""What :func:`mixprec.numerics.tune` returns: a :class:`TunePlan` and the :class:`RunError` of a
run.

Design: the result is plain data, apart from the search that produced it. A ``TunePlan`` is a
``path -> Policy`` mapping (so :func:`mixprec.set_policy` and ``dict(plan)`` take it as it is)
that also carries the evidence -- sensitivities, the errors before and after, why each module
was kept -- so ``plan.explain()`` and ``plan.as_dict()`` need nothing but the plan.

``TunePlan`` is exported from :mod:`mixprec.numerics.tuning` (and :mod:`mixprec`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._core.engine import set_policy
from mixprec._core.policy import Policy
from mixprec.fp8.choice import FP8Choice, FP8Plan
from mixprec.fp8.config import FP8Config


@dataclass
class RunError:
    """How far one mixed-precision run is from fp32.

    Loss mode: relative loss and global-gradient errors, worst batch. Metric mode (``tune(...,
    metric=fn)``): ``metric`` is the run's mean metric over the batches and ``metric_ref`` the
    fp32 run's; ``loss`` and ``grad`` are NaN (not measured).
    """

    loss: float
    grad: float
    loss_scale: float
    metric: float | None = None
    metric_ref: float | None = None

    @property
    def metric_drop(self) -> float | None:
        """``metric_ref - metric`` (inf when the run's metric is not finite)."""
        if self.metric is None or self.metric_ref is None:
            return None
        return self.metric_ref - self.metric if math.isfinite(self.metric) else math.inf

    def within(self, tol: float) -> bool:
        drop = self.metric_drop
        if drop is not None:
            return drop <= tol
        return self.loss <= tol and self.grad <= tol

    def __str__(self) -> str:
        if self.metric_drop is not None:
            return (
                f"metric {self.metric:.4g} (fp32 {self.metric_ref:.4g}, drop "
                f"{self.metric_drop:.3g})"
            )
        return f"loss error {self.loss:.3g}, gradient error {self.grad:.3g}"


@dataclass
class TunePlan(Mapping):
    """Per-module policies found by :func:`tune`: a mapping ``path -> Policy``.

    Attributes:
        fp32_modules: the modules kept in float32, in the order they were chosen.
        sensitivity: each candidate's isolated output error in the low dtype (inf: non-finite).
        before, after: errors of the all-low run and of the tuned run.
        reasons: why each kept module was kept.
    """

    dtype: torch.dtype
    tolerance: float
    policies: dict[str, Policy]
    fp32_modules: list[str]
    sensitivity: dict[str, float]
    before: RunError
    after: RunError
    reasons: dict[str, str] = field(default_factory=dict)
    evaluations: int = 0
    fp8_modules: list[str] = field(default_factory=list)
    fp8_reasons: dict[str, str] = field(default_factory=dict)  # why a candidate stayed 16-bit
    fp8_recipe: str | None = None

    @property
    def fp8(self) -> FP8Config | None:
        """``fp8=`` for :func:`mixprec.initialize` running exactly :attr:`fp8_modules` in FP8
        (None when tune was not asked about FP8)."""
        if self.fp8_recipe is None:
            return None
        choices = {n: FP8Choice(n, True, "tune: within tolerance in FP8") for n in self.fp8_modules}
        choices.update({n: FP8Choice(n, False, r) for n, r in self.fp8_reasons.items()})
        return FP8Config(self.fp8_recipe, layers=FP8Plan(choices, self.fp8_recipe, None))

    def __getitem__(self, key: str) -> Policy:
        return self.policies[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    @property
    def passed(self) -> bool:
        return self.after.within(self.tolerance)

    def apply(self, model: nn.Module) -> nn.Module:
        """``set_policy`` every entry on ``model`` (paths are relative to it); returns it."""
        for path, policy in self.policies.items():
            set_policy(model.get_submodule(path), policy)
        return model

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "tolerance": self.tolerance,
            "policies": {p: str(pol) for p, pol in self.policies.items()},
            "fp32_modules": self.fp32_modules,
            "reasons": self.reasons,
            "sensitivity": {
                k: (v if math.isfinite(v) else "inf") for k, v in self.sensitivity.items()
            },
            "before": _plain(vars(self.before)),
            "after": _plain(vars(self.after)),
            "passed": self.passed,
            "evaluations": self.evaluations,
            "fp8_recipe": self.fp8_recipe,
            "fp8_modules": self.fp8_modules,
            "fp8_reasons": self.fp8_reasons,
        }

    def explain(self, top: int = 5) -> str:
        name = str(self.dtype).replace("torch.", "")
        lines = [
            f"tune ({name}, tolerance {self.tolerance:g}): all {name}: {self.before}; "
            f"tuned: {self.after} ({'within' if self.passed else 'NOT within'} "
            f"tolerance, {self.evaluations} evaluations)"
        ]
        if not self.fp32_modules:
            lines.append(f"  nothing needs float32: every module runs in {name}.")
        for m in self.fp32_modules:
            lines.append(f"  keep '{m or '<model>'}' in float32: {self.reasons[m]}")
        if self.fp8_recipe is not None:
            lines.append(f"  FP8 ({self.fp8_recipe}): {', '.join(self.fp8_modules) or 'no Linear'}")
            for m, why in self.fp8_reasons.items():
                lines.append(f"  keep '{m}' in {name} rather than FP8: {why}")
        ranked = sorted(self.sensitivity.items(), key=lambda kv: -kv[1])
        lines.append(
            "  most sensitive modules (isolated output error in "
            f"{name}): " + ", ".join(f"{p or '<model>'}={e:.3g}" for p, e in ranked[:top])
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe numbers: NaN (not measured) -> None, inf -> "inf"."""
    return {
        k: (
            None
            if isinstance(v, float) and math.isnan(v)
            else "inf"
            if isinstance(v, float) and math.isinf(v)
            else v
        )
        for k, v in values.items()
    }
