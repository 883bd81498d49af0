"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on model parameters, made right for
fp32 masters.

At O2 the gradients that the optimizer steps live on the fp32 master weights; the 16-bit model
parameters hold none after ``opt.backward``. The common torch idiom
``clip_grad_norm_(model.parameters(), max_norm)`` would then measure only the fp32 parameters'
gradients (the norms') and clip nothing the optimizer uses -- silently.

Design: torch's function is wrapped, but only once masters exist -- by the first
``MixedPrecisionOptimizer`` that creates them (:func:`register_masters`), never at
``import mixprec``. The wrapper replaces each 16-bit parameter that has a master by its master
before torch's own code runs, so the norm is the true one and clipping reaches what the
optimizer steps; every other parameter and argument passes through, so for tensors mixprec does
not own the result is torch's, bit for bit. ``opt.clip_grad_norm_(max_norm)`` does the same
explicitly. The alternatives fail: torch's code drops parameters whose ``.grad`` is None before
anything outside it could see them, so the mistake cannot be detected without patching torch,
and an error would break a habit that gives the right result here.

The wrapper is installed on ``torch.nn.utils`` (``torch.nn.utils.clip_grad_norm_``, the spelling
used in practice); a name imported with ``from torch.nn.utils import clip_grad_norm_`` before
the first masters were created keeps torch's original. Where the user's script (``__main__``)
holds one, installing the wrapper warns, naming it and the fix: that name would clip nothing.
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

__all__ = ["refuse_released", "register_masters", "register_released"]

# id(model parameter) -> (weak ref to it, weak ref to its master); by id, since tensors compare
# element-wise (no WeakKeyDictionary)
_master_of: dict[int, tuple[weakref.ref, weakref.ref]] = {}
# id(parameter) -> (weak ref to it, weak ref to the LeanUpdate that may release its gradient)
_released: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_released(params: list[Tensor], owner: Any) -> None:
    """Record parameters whose gradients ``owner`` (a
    :class:`~mixprec._core.update.lean.LeanUpdate`) releases in backward, now
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
            refuse_released(params)
            parameters = [_swap(p) for p in params]
        return original(parameters, *args, **kwargs)

    clip._mixprec_wrapped = True  # type: ignore[attr-defined]
    return clip


def _install() -> None:
    utils = torch.nn.utils
    originals = (utils.clip_grad_norm_, utils.clip_grad_value_)
    if getattr(originals[0], "_mixprec_wrapped", False):
        return
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
        warnings.warn(
            f"{', '.join(names)} in your script is torch's own function, imported before "
            "mixprec created fp32 master weights: on a model's 16-bit parameters it finds no "
            "gradients (they live on the masters) and clips nothing. Call "
            "opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(...) by its "
            "full name, which reaches the masters.",
            MixprecWarning,
            stacklevel=2,
        )
