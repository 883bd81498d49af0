"""Bytes per parameter: what a training configuration keeps in memory, counted from its tensors.

Design: rather than a formula per level (which drifts from the code), :func:`footprint` counts
the tensors that exist -- model weights, the gradient each trainable weight holds during
backward (in its own dtype) plus any persistent fp32 gradient buffers, fp32 masters, Kahan
compensation buffers and optimizer state (deduplicated by storage) -- and divides by the number
of parameters. Optimizer state is created lazily by the first step, so pass ``step`` (a callable
running one training step): it is run ``steps`` times under :class:`mixprec._core.memory.PeakMemory`
first, which also gives the measured peak of a training step. Activations are not per-parameter
and show up only in that peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mixprec._core.memory import PeakMemory
from mixprec._core.update.state_codes import QuantizedState

__all__ = ["CATEGORIES", "Footprint", "footprint"]

CATEGORIES = ("weights", "grads", "masters", "compensation", "optimizer_state")


@dataclass
class Footprint:
    """Bytes held per category (see :data:`CATEGORIES`) for ``params`` parameters."""

    params: int
    bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: int | None = None  # measured peak of ``steps`` training steps (None: not run)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def per_param(self) -> dict[str, float]:
        """Bytes per parameter for each category and ``"total"``."""
        n = max(self.params, 1)
        out = {k: v / n for k, v in self.bytes.items()}
        out["total"] = self.total / n
        return out

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.per_param.items())
        peak = "" if self.peak_bytes is None else f"; peak {self.peak_bytes / 2**20:.0f} MiB"
        return f"{self.params:,} params, bytes/param: {parts}{peak}"


def _nbytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _gradient_bytes(params: list[Tensor], updater: Any, seen: set[int]) -> int:
    """Every trainable weight holds a gradient of its own dtype at the end of backward, but
    where an update mode releases them in backward (none held) or codes them (their codes)."""
    low = (torch.bfloat16, torch.float16)
    how = getattr(updater, "gradients", "held")
    coded = how == "coded"
    total = sum(
        p.numel() * p.element_size()
        for p in params
        if p.requires_grad and not (how != "held" and p.dtype in low)  # released or coded
    )
    if coded:
        kept = updater._code_buffers.values()
        total += _nbytes([t for (codes, scales), norm in kept for t in (codes, scales, norm)], seen)
    return total


def _state_tensors(opt: Optimizer) -> list[Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, QuantizedState):
                out += [v.codes, v.scale]
            elif isinstance(v, Tensor):
                out.append(v)
    return out


def footprint(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    step: Callable[[], Any] | None = None,
    steps: int = 2,
) -> Footprint:
    """Count the bytes a training configuration keeps per parameter.

    Args:
        model: the model (after :func:`mixprec.initialize`, if used).
        optimizer: its optimizer (a :class:`mixprec._core.optimizer.MixedPrecisionOptimizer` or a
        plain one).
        step: optional callable running one full training step (forward, backward, step,
            zero_grad); it is run ``steps`` times under :class:`~mixprec._core.memory.PeakMemory`
            before counting, so that lazily created optimizer state exists.
        steps: how many times to run ``step``.

    Returns:
        A :class:`Footprint`; ``str()`` of it prints bytes per parameter and the peak.

    Example:
        >>> fp = footprint(model, opt, step=train_step)  # doctest: +SKIP
        >>> fp.per_param["total"], fp.peak_bytes          # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"footprint expects an nn.Module, received {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"footprint expects a torch.optim.Optimizer or None, received "
            f"{type(optimizer).__name__}."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, received {steps!r}.")
    peak = None
    if step is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with PeakMemory(device) as mem:
            for _ in range(steps):
                step()
        peak = mem.peak_bytes
    params = list(model.parameters())
    seen: set[int] = set()
    counts = dict.fromkeys(CATEGORIES, 0)
    counts["weights"] = _nbytes(params, seen)
    updater = getattr(optimizer, "updater", None)
    counts["grads"] = _gradient_bytes(params, updater, seen)
    inner = getattr(optimizer, "optimizer", optimizer)
    pairs = getattr(optimizer, "_pairs", [])
    if pairs:
        counts["masters"] = _nbytes([m for _, m in pairs], seen)
        counts["grads"] += _nbytes(getattr(optimizer, "_grad_buffers", {}).values(), seen)
    if updater is not None:
        counts["compensation"] = _nbytes(updater.compensation.values(), seen)
    if inner is not None:
        counts["optimizer_state"] = _nbytes(_state_tensors(inner), seen)
    return Footprint(params=sum(p.numel() for p in params), bytes=counts, peak_bytes=peak)
