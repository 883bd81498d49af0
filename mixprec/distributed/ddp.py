"""DistributedDataParallel with mixprec: the order of wrapping and the 16-bit gradient all-reduce.

:func:`wrap_ddp` wraps a model after ``initialize``, broadcasts the fp32 masters and reduces
gradients in ``reduce_dtype`` (:class:`AllReduceHook`); a plain ``DDP(model)`` is noticed by
:func:`watch_ddp` and made safe by :func:`adopt_ddp`, which the core's hook lists run.
Design: ``docs/design.md``, "Distributed training"; the user's page: ``docs/distributed.md``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at run time.
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec import _initialize as initialize
from mixprec._core import engine, optimizer
from mixprec._core._warnings import MixprecNumericsWarning
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._initialize import _MARK, RECIPE_ATTR  # set by initialize on each model
from mixprec.distributed.verdicts import (
    _optimizers,
    assert_in_sync,
    require_process_group,
    sync_verdicts,
)

__all__ = ["AllReduceHook", "adopt_ddp", "watch_ddp", "wrap_ddp"]

_WIRE = (torch.float16, torch.bfloat16, torch.float32)
_ORDER_FIX = (
    "Build the model, call mixprec.initialize(model, optimizer, ...) on the bare "
    "module, then mixprec.distributed.wrap_ddp(model, optimizer)."
)


class AllReduceHook:
    """DDP communication hook: average gradients with an all-reduce in ``dtype``.

    Register with ``ddp.register_comm_hook(None, AllReduceHook(torch.bfloat16))`` or let
    :func:`wrap_ddp` do it.

    Args:
        dtype: the dtype on the wire (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``).
        group: process group (default: the whole world).
        predivide_factor: divide by this before the sum and by ``world_size / factor`` after
            (Apex/DeepSpeed's ``gradient_predivide_factor``). Default: the world size, so the
            sum of the shares cannot exceed the largest share.

    Attributes:
        calls: buckets all-reduced so far.
        wire_bytes: bytes handed to the all-reduce so far (per rank).
        grad_bytes: bytes the same buckets hold in the gradient dtype.
        wire_dtypes: dtypes that reached the collective.
        elements: gradient elements all-reduced so far (``4 * elements``: the fp32 bytes).
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        group: dist.ProcessGroup | None = None,
        predivide_factor: float | None = None,
    ):
        if dtype not in _WIRE:
            raise ValueError(
                f"AllReduceHook dtype must be one of {list(_WIRE)}, received {dtype!r}."
            )
        if predivide_factor is not None and not (
            isinstance(predivide_factor, (int, float))
            and not isinstance(predivide_factor, bool)
            and predivide_factor >= 1
        ):
            raise ValueError(
                f"predivide_factor must be a number >= 1 (or None for the world "
                f"size), received {predivide_factor!r}."
            )
        self.dtype = dtype
        self.group = group
        self.predivide_factor = predivide_factor
        # DDP checks and logs a hook's name like a function's.
        self.__name__ = self.__qualname__ = f"mixprec_allreduce_{str(dtype).split('.')[-1]}"
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the counters and forget the dtypes seen."""
        self.calls = 0
        self.elements = 0
        self.wire_bytes = 0
        self.grad_bytes = 0
        self.wire_dtypes: set[torch.dtype] = set()

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else self.group
        world = dist.get_world_size(group)
        pre = float(self.predivide_factor or world)
        post = world / pre
        buffer = bucket.buffer()
        if buffer.dtype == self.dtype:
            wire = buffer.div_(pre) if pre != 1 else buffer
        elif buffer.element_size() > torch.finfo(self.dtype).bits // 8:
            wire = (buffer / pre if pre != 1 else buffer).to(self.dtype)  # divide, then narrow
        else:
            wire = buffer.to(self.dtype)  # widen, then divide
            if pre != 1:
                wire.div_(pre)
        self.calls += 1
        self.elements += buffer.numel()
        self.wire_bytes += wire.numel() * wire.element_size()
        self.grad_bytes += buffer.numel() * buffer.element_size()
        self.wire_dtypes.add(wire.dtype)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def write_back(f: torch.futures.Future) -> torch.Tensor:
            reduced = f.value()[0]
            if post != 1:
                reduced.div_(post)
            if reduced is not buffer:
                buffer.copy_(reduced)  # in the gradient dtype, in place (peak memory)
            return buffer

        return fut.then(write_back)

    def __repr__(self) -> str:
        return (
            f"AllReduceHook(dtype={self.dtype}, predivide_factor={self.predivide_factor}, "
            f"calls={self.calls}, wire_bytes={self.wire_bytes})"
        )


def _stale_buckets(ddp: DistributedDataParallel) -> list[str]:
    """Buckets whose dtype no longer matches their parameters' dtype (DDP built too early)."""
    get = getattr(ddp.reducer, "_get_zeros_like_grad_buckets", None)
    if get is None:  # private API gone: fall back to the marker check alone
        return []
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = []
    for bucket in get():
        dtype = bucket.buffer().dtype
        out += [
            f"{names.get(id(p), '?')} is {p.dtype}, its bucket {dtype}"
            for p in bucket.parameters()
            if p.dtype != dtype
        ]
    return out


def _check_order(model: nn.Module) -> None:
    if isinstance(model, DistributedDataParallel):
        if model.__dict__.get(_MARK):
            raise RuntimeError(
                "mixprec.initialize was called on a DistributedDataParallel "
                "wrapper. DDP had already built its gradient buckets for the "
                "old parameter dtypes, so gradients are not averaged correctly "
                f"and the ranks silently diverge. {_ORDER_FIX}"
            )
        stale = _stale_buckets(model)
        if stale:
            raise RuntimeError(
                "This DistributedDataParallel was built before mixprec.initialize "
                f"changed the parameter dtypes ({'; '.join(stale[:3])}): its "
                f"buckets no longer match and the ranks would silently diverge. "
                f"{_ORDER_FIX}"
            )
        if not model.module.__dict__.get(_MARK):
            raise RuntimeError(
                f"The module inside this DDP was not prepared by mixprec.initialize. {_ORDER_FIX}"
            )
        return
    if type(model).__name__.startswith("FSDP") or hasattr(model, "_get_fsdp_state"):
        raise TypeError(
            "This model is sharded with FSDP; use "
            "mixprec.distributed.initialize_fsdp instead of wrap_ddp."
        )
    if not model.__dict__.get(_MARK):
        raise RuntimeError(
            f"wrap_ddp received a {type(model).__name__} that mixprec.initialize "
            f"has not prepared. {_ORDER_FIX}"
        )


def _refuse_released(model: nn.Module) -> None:
    """DDP reduces gradients after they are accumulated; a released one is stepped first."""
    recipe, low = model.__dict__.get(RECIPE_ATTR, (None, None))
    if recipe is not None and recipe.gradients == "coded":
        raise ValueError(
            f"Recipe {str(recipe)!r} codes each gradient in 8 bits as its backward completes "
            "it, before DDP could reduce it. Initialize with gradients='held' (e.g. "
            "Recipe('lean', gradients='held')) to train with DDP."
        )
    if recipe is not None and recipe.releases_gradients(low):
        raise ValueError(
            f"Recipe {str(recipe)!r} releases gradients in backward: each parameter would be "
            "stepped with its own rank's gradient before DDP reduces it. Initialize with "
            "gradients='held' (e.g. Recipe('lean', gradients='held')) to train with DDP."
        )


def _reduce_dtype(model: nn.Module) -> torch.dtype | None:
    """The recipe's ``reduce_dtype``, with ``"auto"`` resolved for this model."""
    recipe, _ = model.__dict__.get(RECIPE_ATTR, (None, None))
    wanted = "auto" if recipe is None else recipe.reduce_dtype
    return _auto_dtype(model) if wanted == "auto" else wanted


def _auto_dtype(model: nn.Module) -> torch.dtype:
    spec = model.__dict__.get(engine.BOUNDARY_ATTR)
    dtype = spec.policy.compute_dtype if spec is not None else torch.float32
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


@torch.no_grad()
def _broadcast_masters(
    opts: list[MixedPrecisionOptimizer], group: dist.ProcessGroup | None
) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for o in opts:
        for t in o.master_params():
            dist.broadcast(t, src=src, group=group)


def wrap_ddp(
    model: nn.Module,
    optimizers: MixedPrecisionOptimizer | Sequence[MixedPrecisionOptimizer] | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    predivide_factor: float | None = None,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap a model prepared by :func:`mixprec.initialize` in DDP, mixed-precision aware.

    Call order: ``model, opt = mixprec.initialize(model, opt, recipe)`` then
    ``model = wrap_ddp(model, opt)``. A DDP built before ``initialize`` is refused with the fix.
    Gradients are all-reduced in the recipe's ``reduce_dtype``: ``"auto"``, the 16-bit compute
    dtype (fp32 at O0); None, DDP's default hook.

    Args:
        model: the initialized module (or a DDP built around it *after* ``initialize``).
        optimizers: the optimizer(s) ``initialize`` returned; their overflow verdicts are
            reduced across ranks (:func:`sync_verdicts`) and their fp32 masters broadcast from
            rank 0.
        process_group: the data-parallel group (default: the world).
        predivide_factor: see :class:`AllReduceHook`.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``device_ids``,
            ``bucket_cap_mb``, ``find_unused_parameters``).

    Returns:
        The DDP module. Its hook is ``ddp.mixprec_comm_hook`` (None for DDP's default).
    """
    require_process_group("wrap_ddp")
    _check_order(model)
    opts = [] if optimizers is None else _optimizers(optimizers)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    _refuse_released(inner)
    comm_dtype = _reduce_dtype(inner)
    if comm_dtype == torch.float16 and any(not o.slot(0).scaler.enabled for o in opts):
        warnings.warn(
            "fp16 gradient all-reduce without loss scaling: gradients below 6e-8 "
            "(and their share after the division by the world size) flush to zero. "
            "Use a recipe with reduce_dtype=torch.bfloat16, or loss_scale='dynamic'.",
            MixprecNumericsWarning,
            stacklevel=2,
        )
    if isinstance(model, DistributedDataParallel):
        if ddp_kwargs or process_group is not None:
            raise ValueError(
                "wrap_ddp got an existing DistributedDataParallel and DDP options "
                f"{sorted(ddp_kwargs) or ['process_group']}; pass the bare module "
                "to have wrap_ddp build DDP with them."
            )
        ddp = model
        process_group = ddp.process_group
    else:
        ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    hook = None
    if comm_dtype is not None:
        hook = AllReduceHook(comm_dtype, group=process_group, predivide_factor=predivide_factor)
        ddp.register_comm_hook(None, hook)
    ddp.mixprec_comm_hook = hook
    if opts:
        _broadcast_masters(opts, process_group)
        sync_verdicts(opts, process_group)
        assert_in_sync(opts, process_group)
    return ddp


class _DDPWatch:
    """Forward pre-hook of :func:`watch_ddp`: records the running DDP on every optimizer whose
    verdicts are not reduced yet, and whether DDP all-reduces this forward's backward (not under
    ``no_sync()``: a scaled backward then leaves the micro-batch's gradients in ``.grad`` for DDP
    to accumulate). A few attribute reads and writes per forward, no collective; a class, not a
    closure, so the model pickles."""

    def __init__(self, optimizers: Sequence[MixedPrecisionOptimizer]):
        self.refs = [weakref.ref(o) for o in optimizers]

    def __call__(self, module: nn.Module, args: Any) -> None:
        ddp = DistributedDataParallel._active_ddp_module
        for ref in self.refs:
            opt = ref()
            if opt is None:
                continue
            # DDP decides at forward whether this backward all-reduces (no_sync)
            opt.unsynced_backward = ddp is not None and not ddp.require_backward_grad_sync
            if ddp is not None and opt.reduce_flags is None and opt._plain_ddp is None:
                opt._plain_ddp = weakref.ref(ddp)

    def __getstate__(self) -> dict[str, Any]:
        return {"refs": []}  # weakrefs do not pickle; a copied model has other parameters


def watch_ddp(model: nn.Module, optimizers: Sequence[MixedPrecisionOptimizer]) -> None:
    """Let ``optimizers`` notice a plain ``DistributedDataParallel`` running ``model``; their
    next ``step()`` then calls :func:`adopt_ddp`."""
    if optimizers and dist.is_available():
        model.register_forward_pre_hook(_DDPWatch(optimizers))


def adopt_ddp(optimizer: MixedPrecisionOptimizer) -> None:
    """Make ``optimizer`` safe under the plain DDP it was seen in, if one was seen since the
    last step (every step runs this: no grad-mode switch before it, one attribute read)."""
    if optimizer._plain_ddp is not None:
        _adopt(optimizer)


def _adopt(optimizer: MixedPrecisionOptimizer) -> None:
    """:func:`adopt_ddp`'s work, a collective on DDP's group; raises if that DDP was built before
    ``initialize`` changed the parameter dtypes (its buckets are stale)."""
    ref, optimizer._plain_ddp = optimizer._plain_ddp, None
    ddp = ref() if ref is not None else None
    if ddp is None or optimizer.reduce_flags is not None:
        return
    stale = _stale_buckets(ddp)
    if stale:
        raise RuntimeError(
            "This model runs inside a DistributedDataParallel built before "
            f"mixprec.initialize changed the parameter dtypes "
            f"({'; '.join(stale[:3])}): its buckets no longer match and the "
            f"ranks would silently diverge. {_ORDER_FIX}"
        )
    group = ddp.process_group
    _broadcast_masters([optimizer], group)  # itself under no_grad
    sync_verdicts(optimizer, group)


initialize.MODEL_HOOKS.append(watch_ddp)
optimizer.SETTLE_HOOKS.append(adopt_ddp)
