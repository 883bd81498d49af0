"""Which op produced a non-finite value: the per-op checks behind :mod:`~mixprec.numerics.locate`.

Design: the checks are plain functions of one aten call (its function, arguments and output),
apart from the dispatch mode and the hooks that call them, so they can be read -- and tested --
alone. The cheap path matters: a finite output costs one fp32-accumulated ``sum``; only a
non-finite one pays for ``isfinite`` and for the question whether this op created it (finite
inputs, no ``-inf`` mask scalar) or passed it on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Tensors in a (nested) tuple/list/dict, in order."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)


def _checkable(t: Tensor) -> bool:
    return (
        t.is_floating_point()
        and t.layout == torch.strided
        and t.device.type != "meta"
        and t.numel() > 0
    )


def has_nonfinite(t: Tensor) -> bool:
    """True when ``t`` holds an inf or NaN (one fp32-accumulated reduction in the common case)."""
    s = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if math.isfinite(s.item()):
        return False
    if t.element_size() == 1:  # FP8 has no isfinite kernel; its values are exact in float32
        t = t.float()
    return not bool(torch.isfinite(t).all())  # the sum may overflow on huge finite values


_LITERALS = ("lift_fresh", "lift_fresh_copy", "scalar_tensor")
# ops whose output is uninitialized memory by contract: garbage NaNs there are not a bug (e.g.
# the optimizer's persistent gradient buffers, filled by the copy that follows)
_UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)
_INFO: dict[Any, tuple[bool, tuple[tuple[int, str], ...]]] = {}


def _op_info(func: Any) -> tuple[bool, tuple[tuple[int, str], ...]]:
    """(skip: a view, which cannot create a value; the (position, name) of args it writes)."""
    name = func.overloadpacket.__name__
    skip = (func.is_view and name not in _LITERALS) or name in _UNINITIALIZED
    written = tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    return skip, written


def _scalars(obj: Any) -> Iterator[float]:
    if isinstance(obj, float):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _scalars(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _scalars(x)


def _produced_here(
    func: Any, args: tuple, kwargs: dict, out: Tensor, written: tuple[tuple[int, str], ...]
) -> bool:
    """Did this op *create* the non-finite value in ``out`` (rather than pass one on)?

    Yes when its floating inputs are all finite and no scalar argument is ``-inf`` (attention
    masks built with ``masked_fill(-inf)`` are intentional), or when it makes a NaN from inputs
    without one (inf - inf, a softmax over a fully masked row).
    """
    if any(v == -math.inf for v in _scalars((args, kwargs))):
        return False
    if func.overloadpacket.__name__ in _LITERALS:  # a Python inf/NaN literal enters the graph
        return not bool((out == -math.inf).all())
    # arguments an in-place op writes to were checked before it ran
    skip_pos = {i for i, _ in written}
    skip_kw = {n for _, n in written}
    inputs = [
        t
        for src in (
            [a for i, a in enumerate(args) if i not in skip_pos],
            {k: v for k, v in kwargs.items() if k not in skip_kw},
        )
        for t in iter_tensors(src)
        if _checkable(t)
    ]
    if not any(has_nonfinite(t) for t in inputs):
        return True
    return bool(torch.isnan(out).any()) and not any(bool(torch.isnan(t).any()) for t in inputs)
