"""Where the optimizer wrapper hands over to the update path: the updater a plan asks for, and
the inner optimizer's step.

:class:`~mixprec._core.optimizer.MixedPrecisionOptimizer` settles the verdict and copies fp32
masters back; what runs in between -- the lean update, torch's fused kernel over O2's fp32
masters, or the optimizer's own step -- is chosen here from its :class:`.choice.UpdatePlan`.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from mixprec._core.update.choice import UpdatePlan
from mixprec._core.update.fp32_step import fused_by_default
from mixprec._core.update.modes import ModeUpdater

__all__ = ["inner_step", "make_updater"]


def make_updater(optimizer: Optimizer, plan: UpdatePlan) -> ModeUpdater | None:
    """The :class:`ModeUpdater` that steps ``optimizer``'s 16-bit parameters, or None where the
    plan keeps fp32 masters or lets the optimizer step the 16-bit weights itself."""
    return None if plan.update is None else ModeUpdater(optimizer, plan)


def inner_step(optimizer: Optimizer, plan: UpdatePlan, updater: ModeUpdater | None) -> Any:
    """One step of the wrapped optimizer on a finite gradient: the lean update's, torch's fused
    kernel over O2's fp32 masters (by default, :mod:`.fp32_step`), or the optimizer's own."""
    if updater is not None:
        return updater.step()
    if plan.masters:
        with fused_by_default(optimizer):
            return optimizer.step()
    return optimizer.step()
