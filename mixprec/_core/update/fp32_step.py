"""torch's fused optimizer kernels for the steps mixprec runs in fp32, unless the user chose.

A torch ``Adam``, ``AdamW`` or ``SGD`` left at ``foreach=None, fused=None`` steps O2's masters
and an update mode's fp32 temporaries through torch's fused kernel (one pass per tensor, 2.5-3.5x
faster on a CPU): :func:`fused_by_default` sets ``group["fused"]`` for that one ``step()`` and
puts it back; torch's default stays where the kernel would refuse or differ (:func:`_fusable`).
Numerics: fp32 rounding order only. ``docs/design.md``, "Master weights and the optimizer".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["fused_by_default"]

#: optimizer classes whose fused kernel runs their own ``step`` (exact types, no subclasses)
FUSABLE = (Adam, AdamW, SGD)
#: device types with fused Adam/AdamW/SGD kernels that this module uses
DEVICES = ("cpu", "cuda")


def _state_ok(t: object, p: Tensor) -> bool:
    if not isinstance(t, Tensor):
        return t is None or isinstance(t, (int, float))
    if t.dim() == 0:  # Adam's step count: fused keeps it on the parameter's device
        return t.device == p.device and t.dtype == torch.float32
    return t.device == p.device and t.dtype == p.dtype and t.layout == torch.strided


def _fusable(optimizer: Optimizer, group: dict) -> bool:
    if group.get("fused") is not None or group.get("foreach") is not None:
        return False  # the user chose
    if group.get("differentiable") or group.get("capturable"):
        return False
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return False
    device = params[0].device
    if device.type not in DEVICES:
        return False
    for p in params:
        g = p.grad
        if (
            p.dtype != torch.float32
            or p.device != device
            or g.dtype != p.dtype
            or g.device != device
            or g.is_sparse
            or g.layout != torch.strided
            or type(p) not in (Tensor, torch.nn.Parameter)  # no DTensor, no subclass
        ):
            return False
        state = optimizer.state.get(p)
        if state and not all(_state_ok(v, p) for v in state.values()):
            return False
    if isinstance(optimizer, SGD) and group.get("momentum"):
        # fused SGD makes every momentum buffer on a first step, or none
        have = {optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in params}
        if len(have) > 1:
            return False
    return True


@contextlib.contextmanager
def fused_by_default(optimizer: Optimizer) -> Iterator[None]:
    """Within the block, groups of a torch Adam/AdamW/SGD left at ``foreach=None,
    fused=None`` whose parameters the fused kernel takes step through it; afterwards the
    groups are as they were. Anything else is left alone."""
    if type(optimizer) not in FUSABLE:
        yield
        return
    chosen = [g for g in optimizer.param_groups if _fusable(optimizer, g)]
    for g in chosen:
        g["fused"] = True
    try:
        yield
    finally:
        for g in chosen:
            g["fused"] = None
