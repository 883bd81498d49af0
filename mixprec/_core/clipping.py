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

__all__ = ["TORCH_CLIPPING", "refuse_released", "register_masters", "register_released"]

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


def refuse_released(params: list[Tensor]) -> None:
    """Raise where a gradient in ``params`` is released (gone before any clip could see them
    all); under ``"auto"``'s first step a clip keeps them held instead."""
    owners = {}
    for p in params:
        hit = _released.get(id(p))
        if hit is not None and hit[0]() is p and (owner := hit[1]()) is not None:
            owners[id(owner)] = owner
    for owner in owners.values():
        why = owner._clip_refusal()
        if why:
            raise RuntimeError(why)


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
                refuse_released(params)
                owners = _coded_owners(params) if original.__name__ == "clip_grad_norm_" else {}
                if owners:
                    return _clip_coded(params, owners, *args, **kwargs)
            parameters = [_swap(p) for p in params]
        return original(parameters, *args, **kwargs)

    clip._mixprec_wrapped = True  # type: ignore[attr-defined]
    return clip


def _coded_owners(params: list[Tensor]) -> dict[int, Any]:
    """id(parameter) -> the updater holding its gradient as codes (``gradients="coded"``)."""
    out = {}
    for p in params:
        hit = _released.get(id(p))
        owner = hit[1]() if hit is not None and hit[0]() is p else None
        if owner is not None and owner.release_mode == "coded" and owner.has_codes(p):
            out[id(p)] = owner
    return out


@torch.no_grad()
def _clip_coded(
    params: list[Tensor],
    owners: dict[int, Any],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``clip_grad_norm_`` over parameters some of whose gradients are codes: the total norm
    from each coded gradient's norm (taken from its 16-bit values as torch takes it) and the
    others' (torch's way), stacked in the order torch stacks them; the coefficient scales the
    held gradients now and the coded ones as the step decodes them."""
    groups: dict[tuple, list[Tensor]] = {}  # torch's grouping: by device and dtype, in order
    for p in params:
        g = p.grad
        if id(p) in owners:
            norm = owners[id(p)].coded_norms([p], float(norm_type))[0]
            groups.setdefault((norm.device, p.dtype), []).append(norm)
        elif g is not None:
            norm = torch.linalg.vector_norm(g, norm_type)
            groups.setdefault((g.device, g.dtype), []).append(norm)
    norms = [n for group in groups.values() for n in group]
    first = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
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
