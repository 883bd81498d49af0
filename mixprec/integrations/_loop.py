"""What a framework's training loop tells the recipe before it starts: ``hold_for_loop``.

``gradients="auto"`` (the "lean" recipe without loss scaling) otherwise lets the first step
decide whether the loop needs every gradient at once (:mod:`mixprec._core.update.release`). A
framework knows it up front -- Trainer clips by ``max_grad_norm``, Lightning by
``gradient_clip_val``, both accumulate over micro-batches -- so its integration asks for held
gradients itself, and says so: the recipe the user named keeps its meaning ("auto"), and the
choice is stated once, with the setting that would release them.
"""

from __future__ import annotations

import warnings
from typing import Any

from mixprec._core._warnings import MixprecWarning, user_stacklevel
from mixprec.recipe import Recipe

__all__ = ["hold_for_loop"]


def hold_for_loop(recipe: Recipe, needs: list[str], where: str, device: Any = None) -> Recipe:
    """``recipe`` with ``gradients="held"`` where its ``"auto"`` would release them and the
    loop ``needs`` them whole (e.g. ``["clips (max_grad_norm=1.0)"]``); else ``recipe``."""
    if recipe.gradients != "auto" or not needs:
        return recipe
    if not recipe.releases_gradients(recipe.resolved_dtype(device)):
        return recipe  # held anyway (loss scaling)
    warnings.warn(
        f"{where}: Recipe {str(recipe)!r} runs with gradients='held' (16 bits until zero_grad, "
        f"2 bytes per parameter) instead of releasing them in backward: the loop "
        f"{' and '.join(needs)}, which needs every gradient at once. Turn that off to release "
        "them, or pass gradients='held' to say so.",
        MixprecWarning,
        stacklevel=user_stacklevel(),
    )
    return recipe.replace(gradients="held")
