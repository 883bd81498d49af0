"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on model parameters, made right for
fp32 masters.

At O2 the gradients that the optimizer steps live on the fp32 master weights; the 16-bit model
parameters hold none after ``opt.backward``. The common torch idiom
``clip_grad_norm_(model.parameters(), max_norm)`` would then measure only the fp32 parameters'
gradients (the norms') and clip nothing the optimizer uses -- silently. mixprec therefore wraps
torch's function once, at import: each 16-bit parameter that has a master is replaced by its
master before torch's own code runs, so the norm is the true one and clipping reaches what the
optimizer steps. Everything else (other parameters, other arguments) passes through unchanged.
``opt.clip_grad_norm_(max_norm)`` does the same explicitly.

The wrapper is installed on ``torch.nn.utils`` (``torch.nn.utils.clip_grad_norm_``, the spelling
used in practice); a name imported with ``from torch.nn.utils import clip_grad_norm_`` before
mixprec was imported keeps torch's original.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["register_masters"]

# id(model parameter) -> (weak ref to it, weak ref to its master); by id, since tensors compare
# element-wise (no WeakKeyDictionary)
_master_of: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_masters(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Record ``(model parameter, fp32 master)`` pairs for the clipping wrapper."""
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
        if _master_of:
            params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            parameters = [_swap(p) for p in params]
        return original(parameters, *args, **kwargs)

    clip._mixprec_wrapped = True  # type: ignore[attr-defined]
    return clip


torch.nn.utils.clip_grad_norm_ = _wrap(torch.nn.utils.clip_grad_norm_)
torch.nn.utils.clip_grad_value_ = _wrap(torch.nn.utils.clip_grad_value_)
