"""What a skipped step's gradients held: the report of ``GradScaler(locate_nonfinite=...)``.

Diagnostics only: it reads the gradients of an optimizer whose step the scaler has just
skipped (so it costs nothing on steps that run) and names the parameters holding inf or NaN.
Which *op* made them is what :func:`mixprec.numerics.locate_nonfinite` answers; the report says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["parameter_names", "skip_report"]

_LISTED = 8  # parameters named in one report; the rest are counted


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): dotted name}`` for naming gradients in a report."""
    return {id(p): name for name, p in model.named_parameters()}


def _values(grad: Tensor) -> Tensor:
    local = getattr(grad, "_local_tensor", None)  # a DTensor (FSDP2): this rank's shard
    grad = local if isinstance(local, Tensor) else grad
    return grad.coalesce()._values() if grad.is_sparse else grad


@torch.no_grad()
def skip_report(
    optimizer: Any, scale: float, names: dict[int, str] | None = None, label: str = ""
) -> str:
    """A readable account of the non-finite gradients of ``optimizer``'s parameters.

    Args:
        optimizer: the optimizer whose step was skipped.
        scale: the loss scale the gradients were computed at.
        names: ``{id(parameter): name}`` (:func:`parameter_names`); positions otherwise.
        label: what skipped the step, for the first line.
    """
    names = names or {}
    bad: list[str] = []
    total = infs = nans = 0
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            total += 1
            g = _values(p.grad)
            n_inf, n_nan = int(torch.isinf(g).sum()), int(torch.isnan(g).sum())
            if n_inf or n_nan:
                infs, nans = infs + n_inf, nans + n_nan
                where = names.get(id(p), f"param_groups[{gi}]['params'][{pi}]")
                dtype = str(p.grad.dtype).replace("torch.", "")
                bad.append(f"  {where}: {dtype}{list(p.grad.shape)}, {n_inf} inf, {n_nan} nan")
    lines = [
        f"{label or 'GradScaler'} skipped the step of {type(optimizer).__name__} at loss scale "
        f"{scale:g}: {len(bad)} of {total} gradients hold inf/NaN ({infs} inf, {nans} nan)."
    ]
    lines += bad[:_LISTED]
    if len(bad) > _LISTED:
        lines.append(f"  ... and {len(bad) - _LISTED} more")
    if nans == 0 and scale > 1:
        lines.append(
            "Infs only, at a loss scale above 1: the scaled gradients overflowed, which dynamic "
            "scaling expects while it searches for the largest safe scale; the scale backs off."
        )
    else:
        lines.append(
            "NaN, or inf at a loss scale of 1 or less, is not a scaling overflow: find the op "
            "that made it with `with mixprec.numerics.locate_nonfinite(model, scaler): ...` "
            "around a few training steps."
        )
    return "\n".join(lines)
