"""Where a model's tensors are stored: the cast to 16 bits and the return of what stays fp32.

``initialize`` casts parameters and floating buffers in place (Parameter objects keep their
identity), reading the :class:`~mixprec.Recipe`'s own fields (typed ``Any``: the core imports
nothing above it). Design: ``docs/design.md``, "One training step through the code".
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from mixprec._core._warnings import MixprecNumericsWarning, MixprecWarning, user_stacklevel
from mixprec._core.norms import is_norm
from mixprec._core.policy import get_policy

__all__ = ["ACCEPT_16BIT_ATTR", "FROZEN_ATTR", "cast_storage", "keep_frozen", "restore_fp32"]

_LOW = (torch.float16, torch.bfloat16)
_SECOND_ROUNDING = {
    torch.bfloat16: "to bfloat16's 8 significant bits, float16 has 11",
    torch.float16: "into float16's range: beyond 65504 overflows, below 6e-8 flushes to 0",
}
#: set on a model by a caller that takes it in whatever dtypes it has (Apex's
#: ``allow_incoming_model_not_fp32``): kept as it is at O0/O1, cast without a warning at O2/O3
ACCEPT_16BIT_ATTR = "_mixprec_accept_16bit"
FROZEN_ATTR = "_mixprec_frozen_fp32"  # {param name in its module: fp32 copy}, frozen_masters


def _overflows(before: Tensor, after: Tensor) -> bool:
    """True when the cast made a finite value infinite, or a nonzero value zero."""
    return bool(
        (torch.isfinite(before) & ~torch.isfinite(after)).any()
        or ((before != 0) & (after == 0)).any()
    )


def _pre_cast_value(p: Tensor) -> Tensor:
    """``p``'s value before the cast: its own storage when no other tensor shares it, else a
    copy (the reason is in the module's design section)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: a copy where missing
    data = p.data  # its own version counter: p's later in-place writes do not touch it
    # held by p, by data and by the storage object the count is read through: 3 when alone
    if use_count is not None and use_count(data.untyped_storage()._cdata) == 3:
        return data
    return data.clone()


def cast_storage(
    module: nn.Module,
    dtype: torch.dtype,
    keep_fp32: str,
    keep: set[int] | None = None,
    kept: dict[int, Tensor] | None = None,
) -> None:
    """Store parameters and floating buffers in ``dtype``, skipping the modules ``keep_fp32``
    names (``"norms"``); the parameters whose id is in ``keep`` leave their pre-cast value in
    ``kept``."""
    own = get_policy(module)
    if own is not None:
        dtype = own.param_dtype
    if not (keep_fp32 == "norms" and is_norm(module)):
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float64 and p.dtype != dtype:
                if keep is not None and kept is not None and id(p) in keep and id(p) not in kept:
                    kept[id(p)] = _pre_cast_value(p)
                p.data = p.data.to(dtype)
        cast_buffers(module, dtype)
    for child in module.children():
        cast_storage(child, dtype, keep_fp32, keep, kept)


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Store ``module``'s own floating buffers (float64 aside) in ``dtype``; one that would
    overflow or flush to zero there stays as it is, with a warning."""
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.is_floating_point() and b.dtype != torch.float64:
            cast = b.to(dtype)
            if _overflows(b, cast):  # e.g. 1e5 in fp16: inf, then NaN outputs, all skipped
                warnings.warn(
                    f"Buffer {type(module).__name__}.{name} holds values outside {dtype}'s "
                    f"range (|x| up to {b.abs().max().item():.3g}, nonzero values that "
                    f"would flush to 0 or overflow); it stays {b.dtype}.",
                    MixprecNumericsWarning,
                    stacklevel=user_stacklevel(),
                )
                continue
            module._buffers[name] = cast


def _stays_fp32(recipe: Any, weights: str, module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are float32 under ``recipe`` with ``weights``."""
    return weights == "fp32" or (recipe.keep_fp32 == "norms" and is_norm(module))


def restore_fp32(
    model: nn.Module,
    recipe: Any,
    dtype: torch.dtype,
    warn: bool = True,
    *,
    weights: str | None = None,
) -> None:
    """Give a model that arrived in 16 bits back what ``recipe`` keeps in float32 (parameters and
    their modules' buffers), with one warning; ``weights`` overrides the recipe's where a
    wrapper stores them otherwise (FSDP's fp32 shards: ``"fp32"``)."""
    if any(p.dtype in _LOW for p in model.parameters()):  # else: nothing to give back
        _restore(model, recipe, dtype, warn, recipe.weights if weights is None else weights)


def _restore(model: nn.Module, recipe: Any, dtype: torch.dtype, warn: bool, weights: str) -> None:
    """:func:`restore_fp32` of a model that holds 16-bit parameters."""
    found: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    total = widened = 0
    for module in model.modules():
        fp32 = _stays_fp32(recipe, weights, module)
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            total += 1
            if p.dtype in _LOW:
                found[p.dtype] = found.get(p.dtype, 0) + 1
                if fp32:
                    p.data = p.data.to(torch.float32)
                    widened += 1
    for module in model.modules():  # the buffers beside the parameters the level keeps fp32
        if _stays_fp32(recipe, weights, module):
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.dtype in _LOW:
                    module._buffers[name] = b.to(torch.float32)
    if warn:
        _warn_16bit(found, total, widened, dtype, recipe, weights)


def _warn_16bit(
    found: dict[torch.dtype, int],
    total: int,
    widened: int,
    dtype: torch.dtype,
    recipe: Any,
    weights: str,
) -> None:
    """The one warning of :func:`restore_fp32`: what arrived, what the level keeps, the fix."""
    level = recipe.level
    names = " and ".join(f"{d} ({n} of {total} parameters)" for d, n in found.items())
    if weights == "fp32":
        keeps, starts = "every parameter", "the float32 weights"
    elif recipe.masters:
        keeps = "norm layers and master weights" if widened else "master weights"
        starts = "the float32 master weights"
    else:
        other = [d for d in found if d != dtype]
        if other:
            warnings.warn(
                f"initialize received a model in {names}: level {level} stores every weight "
                f"in {dtype}, so its {other[0]} weights are converted, rounding them a second "
                f"time ({_SECOND_ROUNDING[dtype]}). Pass dtype={other[0]} to keep them as they "
                "are, or build or load the model in float32 and let initialize cast it.",
                MixprecWarning,
                stacklevel=user_stacklevel(),
            )
        return
    warnings.warn(
        f"initialize received a model already cast to {names}: level {level} keeps {keeps} "
        f"in float32, so initialize upcasts them, but {starts} start from the rounded 16-bit "
        f"values, not from the float32 values they were cast from. Build or load the model in "
        f"float32 and let initialize cast it: drop the model.half() / "
        f"model.to({next(iter(found))}) before initialize.",
        MixprecWarning,
        stacklevel=user_stacklevel(),
    )


def keep_frozen(module: nn.Module) -> None:
    """Exact fp32 copies of the frozen floating parameters, by name (the model still pickles),
    for :func:`mixprec.fp32_state_dict` (+4 bytes each)."""
    for sub in module.modules():
        frozen = {
            n: p.detach().float().clone()
            for n, p in sub._parameters.items()
            if p is not None and not p.requires_grad and p.is_floating_point()
        }
        if frozen:
            sub.__dict__[FROZEN_ATTR] = frozen
