"""Rank-consistent overflow verdicts: every rank skips the same steps, every scaler agrees.

Design (``docs/design.md``, "Distributed training"): each rank checks only
the gradients it holds -- all of them under DDP, only its shard under FSDP -- so a non-finite
value can be seen by one rank alone. If that rank skipped the step on its own, the ranks'
weights and loss scales would drift apart without any error (DeepSpeed's ``CheckOverflow``
reduces the overflow flag across data-parallel ranks for the same reason).

:class:`FlagReducer` plugs into ``MixedPrecisionOptimizer.reduce_flags``: the optimizer hands
it every verdict flag of the step (found-inf flags and the per-loss-scaler flags) just before
its single host read. The flags are packed into one tensor, reduced with ``MAX`` in **one**
collective (a flag is >= 0, so MAX keeps "non-finite somewhere" and cannot overflow), and
unpacked. Each rank then reads the same values, skips the same steps and applies the same
updates to its loss scalers, so the scale stays identical everywhere.

Requirement: every rank calls ``step()`` after the same number of scaled backward passes (the
flag lists then have the same length on every rank), which data-parallel training does anyway.
:func:`assert_in_sync` checks the outcome (scales and skip counters) across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mixprec._core.optimizer import MixedPrecisionOptimizer

__all__ = ["FlagReducer", "assert_in_sync", "sync_verdicts"]


def require_process_group(what: str) -> None:
    """Raise a clear error when ``torch.distributed`` is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialized process group: call "
            "torch.distributed.init_process_group(backend) first (launch with "
            "torchrun; backend 'gloo' on CPU, 'nccl' on CUDA)."
        )


def _optimizers(optimizers: Any) -> list[MixedPrecisionOptimizer]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    bad = [type(o).__name__ for o in opts if not isinstance(o, MixedPrecisionOptimizer)]
    if bad or not opts:
        raise TypeError(
            "Expected the optimizer(s) returned by mixprec.initialize "
            f"(MixedPrecisionOptimizer), received {bad or 'nothing'}."
        )
    return opts


class FlagReducer:
    """``reduce_flags`` hook: all-reduce (MAX) every verdict flag in one collective.

    Args:
        group: the process group whose ranks must agree (default: the whole world).

    Attributes:
        calls: collectives issued so far (one per optimizer step).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.calls = 0

    def __call__(self, flags: list[Tensor]) -> list[Tensor]:
        if not flags:
            return flags
        device = flags[0].device
        packed = torch.cat([f.reshape(1).to(device=device, dtype=torch.float32) for f in flags])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        self.calls += 1
        # The optimizer reads the returned flags with one host sync per device: keep them on
        # one device (views of the reduced tensor), whatever devices the inputs were on.
        return list(packed.split(1))

    def __repr__(self) -> str:
        return f"FlagReducer(group={self.group!r}, calls={self.calls})"


def sync_verdicts(
    optimizers: MixedPrecisionOptimizer | Sequence[MixedPrecisionOptimizer],
    group: dist.ProcessGroup | None = None,
) -> FlagReducer:
    """Make ``optimizers`` reduce their overflow verdicts across the ranks of ``group``.

    After this, an inf/NaN gradient on any rank skips the step on every rank, and every rank's
    loss scalers see the same verdicts. :func:`mixprec.distributed.wrap_ddp` and
    :func:`mixprec.distributed.initialize_fsdp` call it for you. Returns the installed hook.
    """
    require_process_group("sync_verdicts")
    reducer = FlagReducer(group)
    for o in _optimizers(optimizers):
        o.reduce_flags = reducer
    return reducer


def _sync_state(opt: MixedPrecisionOptimizer) -> list[float]:
    values: list[float] = [float(opt.skipped_steps), float(opt.step_skipped)]
    for slot in opt.slots:
        s = slot.scaler
        values += [
            s.scale,
            float(s.steps),
            float(s.skipped_steps),
            float(s.growth_tracker),
            float(s.hysteresis_tracker),
        ]
    return values


def assert_in_sync(
    optimizers: MixedPrecisionOptimizer | Sequence[MixedPrecisionOptimizer],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise if the ranks disagree on loss scales, scaler counters or skipped steps.

    Costs two small collectives; meant for tests, debugging and the start of a resumed run.
    """
    require_process_group("assert_in_sync")
    opts = _optimizers(optimizers)
    local = torch.tensor([v for o in opts for v in _sync_state(o)], dtype=torch.float64)
    low, high = local.clone(), local.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise RuntimeError(
            "mixprec optimizers differ across ranks (per optimizer: skipped_steps, step_skipped, "
            "then per loss scaler: scale, steps, skipped_steps, growth_tracker, "
            f"hysteresis_tracker): this rank {local.tolist()}, minimum {low.tolist()}, maximum "
            f"{high.tolist()}. Call mixprec.distributed.sync_verdicts(optimizer) on every rank "
            "(wrap_ddp / initialize_fsdp do) and run the same number of backward passes per "
            "step on every rank."
        )
