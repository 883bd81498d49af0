"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on model parameters, made right for
fp32 masters.

Design (``docs/design.md``, "Master weights and the optimizer"): at O2 the 16-bit parameters hold
no gradient after ``opt.backward``, so torch's idiom would silently clip nothing. The first
optimizer that makes masters wraps torch's two functions (never ``import mixprec``): each
parameter with a master is replaced by its master, everything else passes through to torch's
code. A name the user's script bound before that keeps torch's original, with a warning.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from mixprec._core._warnings import MixprecWarning

__all__ = [
    "TORCH_CLIPPING",
    "clip_coded",
    "refuse_released",
    "register_masters",
    "register_released",
]

# id(model parameter) -> (weak ref to it, weak ref to its master); by id, since tensors compare
# element-wise (no WeakKeyDictionary)
_master_of: dict[int, tuple[weakref.ref, weakref.ref]] = {}
# id(parameter) -> (weak ref to it, weak ref to the ModeUpdater that may release its gradient)
_released: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: torch's own functions by name, as they were before the wrappers replaced them
TORCH_CLIPPING: dict[str, Any] = {}


def register_released(params: list[Tensor], owner: Any) -> None:
    """Record parameters whose gradients ``owner`` (a
    :class:`~mixprec._core.update.modes.ModeUpdater`) releases in backward, now
    (``gradients="released"``) or once its first step has shown that the loop allows it
    (``"auto"``): a clip of them asks the owner (``_clip_refusal``)."""
    if params:
        _install()
    for p in params:
        _released[id(p)] = (weakref.ref(p), weakref.ref(owner))


def refuse_released(params: list[Tensor], coded_clip: bool = True) -> dict[int, Any]:
    """Raise where a gradient in ``params`` is released (gone before any clip could see them
    all); under ``"auto"``'s first step a clip keeps them held or coded instead.
    ``coded_clip``: whether the clip can read coded gradients (a 2-norm clip). Returns
    id(parameter) -> the updater holding its gradient as codes (``gradients="coded"``)."""
    owners = {}
    for p in params:
        hit = _released.get(id(p))
        if hit is not None and hit[0]() is p and (owner := hit[1]()) is not None:
            owners[id(p)] = (p, owner)
    for owner in {id(o): o for _, o in owners.values()}.values():
        why = owner._clip_refusal(coded_clip)
        if why:
            raise RuntimeError(why)
    return {i: o for i, (p, o) in owners.items() if o.has_codes(p)}  # after: a clip may decode


def register_masters(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Record ``(model parameter, fp32 master)`` pairs for the clipping wrapper, which the first
    pairs install."""
    if pairs:
        _install()
    for key in [k for k, (p, _) in _master_of.items() if p() is None]:
        del _master_of[key]  # parameters that are gone
    for param, master in pairs:
        _master_of[id(param)] = (weakref.ref(param), weakref.ref(master))


def _swap(p: Tensor) -> Tensor:
    hit = _master_of.get(id(p))
    if hit is None or hit[0]() is not p:
        return p
    master = hit[1]()
    return p if master is None else master


def _wrap(original: Any) -> Any:
    if getattr(original, "_mixprec_wrapped", False):
        return original

    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _master_of or _released:
            params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            if _released:
                by_norm = original.__name__ == "clip_grad_norm_"
                norm = kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0)
                coded = refuse_released(params, by_norm and float(norm) == 2.0)
                if coded and by_norm:
                    return clip_coded(params, coded, *args, **kwargs)
            parameters = [_swap(p) for p in params]
        return original(parameters, *args, **kwargs)

    clip._mixprec_wrapped = True  # type: ignore[attr-defined]
    return clip


#: torch's words for a non-finite total norm under ``error_if_nonfinite``
_NONFINITE = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


@torch.no_grad()
def clip_coded(
    params: list[Tensor],
    owners: dict[int, Any],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``clip_grad_norm_`` over parameters some of whose gradients are codes: each coded one's
    norm (taken from its 16-bit values), the others' as torch takes them, stacked in torch's
    order (by device and dtype); the coefficient scales held gradients now, coded ones as the
    step decodes them."""
    groups: dict[tuple, list[Tensor]] = {}
    for p in [p for p in params if id(p) in owners or p.grad is not None]:
        coded = id(p) in owners
        norm = owners[id(p)].coded_norm(p) if coded else torch.linalg.vector_norm(p.grad, norm_type)
        groups.setdefault((norm.device, p.dtype), []).append(norm)
    norms = [n.to(params[0].device) for group in groups.values() for n in group]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(_NONFINITE.format(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if id(p) not in owners and p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    for owner in {id(o): o for o in owners.values()}.values():
        owner.clip_coef = coef if owner.clip_coef is None else owner.clip_coef * coef
    return total


def _install() -> None:
    utils = torch.nn.utils
    originals = (utils.clip_grad_norm_, utils.clip_grad_value_)
    if getattr(originals[0], "_mixprec_wrapped", False):
        return
    TORCH_CLIPPING.update((f.__name__, f) for f in originals)
    utils.clip_grad_norm_, utils.clip_grad_value_ = (_wrap(f) for f in originals)
    _warn_if_bound(originals)


def _warn_if_bound(originals: tuple[Any, ...]) -> None:
    """Warn when the user's script bound torch's own clipping functions by name."""
    main = sys.modules.get("__main__")
    names = [
        name
        for name, value in list(getattr(main, "__dict__", {}).items())
        if any(value is f for f in originals)
    ]
    if names:
        _warn_bound(names)


def _warn_bound(names: list[str]) -> None:
    warnings.warn(
        f"{', '.join(names)} in your script is torch's own function, imported before "
        "mixprec created fp32 master weights: on a model's 16-bit parameters it finds no "
        "gradients (they live on the masters) and clips nothing. Call "
        "opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(...) by its "
        "full name, which reaches the masters.",
        MixprecWarning,
        stacklevel=3,  # as seen from _warn_if_bound
    )
