"""How each optimizer's step writes the weights: one :class:`UpdatePlan` per optimizer.

Design: where a decision is per optimizer the machinery reads an :class:`UpdatePlan`, a small
frozen value in the Recipe's own words (``masters``, ``update``, ``optimizer_states``,
``update_seed``, ``gradients``) built by :func:`update_plans`; every other decision reads the
:class:`~mixprec.Recipe` itself. ``update="auto"`` is decided here per optimizer, because the
right choice depends on the optimizer (Adam's eps) and its gradients (sparse ones need the
optimizer's own step). The core imports nothing above it: the recipe is read by its fields.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from mixprec._core._warnings import MixprecNumericsWarning, user_stacklevel
from mixprec._core.update.state_codes import FIRST_MOMENTS

__all__ = ["UpdatePlan", "resolved_for", "update_plans"]


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How one optimizer's step writes the model's weights, in the Recipe's words (built from
    a recipe whose rules, ``mixprec._recipe_rules``, checked these fields).

    Args:
        masters: step fp32 master copies of the 16-bit weights (the Recipe's ``masters``).
        update: without masters, how the fp32 result is written into 16-bit weights:
            ``"nearest"``, ``"kahan"``, ``"stochastic"``, or None (the optimizer's own step).
        optimizer_states: how states are held under an update mode (the Recipe's values:
            ``"auto"``, a dtype, ``"8-bit"``, ``"4-bit"``, or ``{state name: one of these}``
            or its sorted item tuple).
        update_seed: the seed of ``"stochastic"`` rounding.
        gradients: ``"held"``, ``"released"`` (stepped in backward and freed) or ``"auto"``
            (the first step decides: a clip or an accumulation keeps them held, a step without
            either releases them from then on; :mod:`mixprec._core.update.release`).
        kernels: the Recipe's: ``"auto"`` steps an update mode in one compiled pass per
            parameter where :mod:`mixprec._core.update.fused` takes it, ``"torch"`` never.
    """

    masters: bool = True
    update: str | None = None
    optimizer_states: Any = "auto"
    update_seed: int = 0
    gradients: str = "held"
    kernels: str = "auto"


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
            MixprecNumericsWarning,
            stacklevel=user_stacklevel(),
        )


def update_plans(
    recipe: Any, optimizers: list[Optimizer], models: list[nn.Module], dtype: torch.dtype
) -> list[UpdatePlan]:
    """One :class:`UpdatePlan` per optimizer for ``recipe`` (a resolved :class:`mixprec.Recipe`)
    run in ``dtype``: the recipe's ``update``, ``optimizer_states``, ``update_seed`` and
    ``gradients``, ``update="auto"`` decided per optimizer where 16-bit weights have no masters."""
    if recipe.weights != "16-bit" or recipe.masters:  # the recipe's rules: no update mode here
        return [UpdatePlan(masters=recipe.masters) for _ in optimizers]
    return _mode_plans(recipe, optimizers, models, dtype)


def _mode_plans(
    recipe: Any, optimizers: list[Optimizer], models: list[nn.Module], dtype: torch.dtype
) -> list[UpdatePlan]:
    """:func:`update_plans` where an update mode can run (16-bit weights, no masters)."""
    if recipe.update == "auto":
        sparse = _sparse_grad_params(models)
        updates = [_default_update(o, dtype, sparse) for o in optimizers]
    else:
        updates = [recipe.update for _ in optimizers]
    given = dict(
        optimizer_states=_resolved_states(recipe.optimizer_states, dtype),
        update_seed=recipe.update_seed or 0,
        kernels=recipe.kernels,
        gradients=recipe.gradients,  # resolved: "held" where they cannot be released
    )
    plans = [  # states, seed and gradients go where a mode runs
        UpdatePlan(masters=False, update=u, **(given if u is not None else {})) for u in updates
    ]
    if None in updates:
        _check_own_steps(recipe, optimizers, plans, dtype)
    return plans


def _resolved_states(states: Any, dtype: torch.dtype) -> Any:
    """``optimizer_states="auto"`` as what it means: first moments in ``dtype``, the others
    (unnamed) fp32."""
    if states != "auto":
        return states
    return tuple(sorted((key, dtype) for key in FIRST_MOMENTS))


def resolved_for(recipe: Any, plan: UpdatePlan) -> Any:
    """``recipe`` (resolved for the device: :meth:`mixprec.Recipe.resolve`) as the optimizer of
    ``plan`` runs it: its ``update``, ``optimizer_states``, ``update_seed`` and ``gradients``."""
    if plan.masters or recipe.weights != "16-bit":
        return recipe
    if plan.update is None:  # the optimizer's own 16-bit step
        return dataclasses.replace(recipe, update=None, optimizer_states="auto", update_seed=None)
    return dataclasses.replace(
        recipe,
        update=plan.update,
        optimizer_states=plan.optimizer_states,
        update_seed=plan.update_seed,
        gradients=plan.gradients,
    )


def _check_own_steps(
    recipe: Any, optimizers: list[Optimizer], plans: list[UpdatePlan], dtype: torch.dtype
) -> None:
    """Where some optimizer steps with its own 16-bit update (``update`` None): refused where
    the recipe's update-mode fields then apply to none, warned where 16-bit arithmetic loses
    its eps."""
    for o, plan in zip(optimizers, plans):
        if plan.update is None and recipe.gradients in ("released", "coded"):  # "auto" holds
            raise ValueError(
                f"Recipe(gradients={recipe.gradients!r}): such gradients are stepped by an update "
                f"mode, but {type(o).__name__} here steps with its own 16-bit update "
                "(sparse gradients, or fp16 without Adam's eps). Set update="
                "'stochastic' or 'kahan', or gradients='held'."
            )
    fields = [  # the update-mode fields the recipe sets, by name
        name
        for name, on in (
            ("gradients", recipe.gradients != "held"),
            ("optimizer_states", recipe.optimizer_states != "auto"),
            ("update_seed", recipe.update_seed is not None),
        )
        if on
    ]
    if fields and all(p.update is None for p in plans):
        raise ValueError(
            f"Recipe fields {fields} apply to an update mode, and every optimizer here steps "
            "with its own 16-bit update (sparse gradients, or an fp16 optimizer without Adam's "
            "eps); set update='nearest', 'kahan' or 'stochastic', or drop them."
        )
    # an update mode does its arithmetic in fp32; 16-bit arithmetic may lose eps
    own = [o if p.update is None else None for o, p in zip(optimizers, plans)]
    _warn_vanishing_eps(own, dtype)
