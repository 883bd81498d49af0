"""Which update each optimizer gets when 16-bit weights have no fp32 masters.

Design: a recipe's ``update="auto"`` is decided per optimizer, because the right choice depends
on the optimizer (Adam's eps and second moment) and on the gradients it sees (sparse ones need
the optimizer's own step). The reasons are in :mod:`mixprec._initialize`'s docstring.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from mixprec._core._warnings import user_stacklevel

__all__ = ["update_options"]

_FIELD = {"state_dtype": "optimizer_states", "release": "gradients"}  # keyword -> Recipe field


def _sparse_grad_params(models: list[nn.Module]) -> set[int]:
    """ids of the weights that get sparse gradients: ``nn.Embedding(Bag)(sparse=True)``."""
    return {
        id(m.weight)
        for model in models
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }


def _default_update(
    optimizer: Optimizer, dtype: torch.dtype, sparse: set[int] | None = None
) -> str | None:
    """The ``update`` an optimizer gets without fp32 masters (O3) when none is given.

    ``"kahan"`` for bf16 with any optimizer, and for fp16 with an Adam-family optimizer
    (``betas`` in its defaults) or an ``eps`` that rounds to 0 in fp16; otherwise None (the
    optimizer's own 16-bit step). Update modes need dense gradients, so ``SparseAdam`` and an
    optimizer holding a parameter whose id is in ``sparse`` (a sparse embedding) get None.
    The module docstring gives the reasons.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(optimizer, torch.optim.SparseAdam) or any(
        id(p) in (sparse or ()) for p in params
    ):
        return None
    if dtype == torch.bfloat16:
        return "kahan"
    if dtype == torch.float16 and (
        "betas" in optimizer.defaults or _vanishing_eps([optimizer], dtype)
    ):
        return "kahan"
    return None


def _vanishing_eps(
    optimizers: list[Optimizer | None], dtype: torch.dtype
) -> tuple[int, float] | None:
    """``(optimizer index, eps)`` of the first ``eps`` that rounds to 0 in ``dtype``, or None.
    None entries (optimizers that need no check) are skipped."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # smallest subnormal
    for i, o in enumerate(optimizers):
        for group in [] if o is None else o.param_groups:
            eps = group.get("eps")
            if isinstance(eps, float) and 0 < eps < tiny:
                return i, eps
    return None


def _warn_vanishing_eps(optimizers: list[Optimizer | None], dtype: torch.dtype) -> None:
    """Without masters the optimizer's arithmetic runs in ``dtype``: an ``eps`` that rounds to 0
    there (Adam's 1e-8 in fp16) turns a zero gradient into 0/0 = NaN on the first step."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # smallest subnormal
    found = _vanishing_eps(optimizers, dtype)
    if found is not None:
        i, eps = found
        warnings.warn(
            f"Optimizer {i} has eps={eps:g}, which rounds to 0 in {dtype} (smallest positive "
            f"value {tiny:.3g}); without fp32 master weights its update can divide 0 by 0. Use "
            "a recipe with update='kahan', one with fp32 masters (O2), or eps >= 1e-4.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def update_options(
    lean: dict[str, Any], optimizers: list[Optimizer], models: list[nn.Module], dtype: torch.dtype
) -> list[dict[str, Any]]:
    """The update-mode keywords of each optimizer's wrapper, ``lean`` (the recipe's given
    ``update``, ``state_dtype``, ``update_seed``) completed by the per-optimizer default."""
    options = [dict(lean) for _ in optimizers]
    sparse = _sparse_grad_params(models)
    for i, (o, kw) in enumerate(zip(optimizers, options)):
        if "update" not in kw:
            kw["update"] = _default_update(o, dtype, sparse)
            if kw["update"] is None:  # state_dtype / update_seed go where a mode runs
                if kw.get("release") is True:  # "auto" holds them here
                    raise ValueError(
                        "Recipe(gradients='released'): gradients are released by an update "
                        f"mode, but {type(o).__name__} here steps with its own 16-bit update "
                        "(sparse gradients, or fp16 without Adam's eps). Set update="
                        "'stochastic' or 'kahan', or gradients='held'."
                    )
                options[i] = {"update": None}
    if set(lean) - {"update"} and all(kw["update"] is None for kw in options):
        raise ValueError(
            f"Recipe fields {sorted(_FIELD.get(k, k) for k in set(lean) - {'update'})} apply "
            "to an update mode, and "
            "every optimizer here steps with its own 16-bit update (sparse gradients, or an "
            "fp16 optimizer without Adam's eps); set update='nearest', 'kahan' or "
            "'stochastic', or drop them."
        )
    # an update mode does its arithmetic in fp32; 16-bit arithmetic may lose eps
    _warn_vanishing_eps(
        [o if kw["update"] is None else None for o, kw in zip(optimizers, options)], dtype
    )
    return options
