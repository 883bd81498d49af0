"""What a framework's training loop tells the recipe before it starts: ``gradients_for_loop``.

``gradients="auto"`` (the "lean" recipe without loss scaling) otherwise lets the first step
decide whether the loop needs every gradient at once (:mod:`mixprec._core.update.release`). A
framework knows it up front -- Trainer clips by ``max_grad_norm``, Lightning by
``gradient_clip_val``, both accumulate over micro-batches -- so its integration names the
gradients such a loop takes and says so: coded in 8 bits as they complete (a 2-norm clip and
accumulation read codes), or held in 16 bits where the loop needs the gradients themselves (a
clip by value) or reduces them across ranks (DDP reduces after backward accumulates them). The
recipe the user named keeps its meaning ("auto"), and the choice is stated once, with the
setting that would release them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec._core._warnings import MixprecWarning, user_stacklevel
from mixprec.recipe import Recipe

__all__ = ["gradients_for_loop"]


def gradients_for_loop(
    recipe: Recipe, needs: list[str], where: str, device: Any = None, whole: bool = False
) -> Recipe:
    """``recipe`` with ``gradients="coded"`` (``"held"`` where the loop needs them ``whole``,
    or runs on several ranks) where its ``"auto"`` would release them and the loop ``needs``
    them all at once (e.g. ``["clips (max_grad_norm=1.0)"]``); else ``recipe``."""
    if recipe.gradients != "auto" or not needs:
        return recipe
    if not recipe.releases_gradients(recipe.resolved_dtype(device)):
        return recipe  # held anyway (loss scaling)
    ranks = torch.distributed.is_available() and torch.distributed.is_initialized()
    held = whole or (ranks and torch.distributed.get_world_size() > 1)
    how = (
        "gradients='held' (16 bits until zero_grad, 2 bytes per parameter)"
        if held
        else "gradients='coded' (8 bits from backward to the step, 1 byte per parameter)"
    )
    warnings.warn(
        f"{where}: Recipe {str(recipe)!r} runs with {how} instead of releasing them in "
        f"backward: the loop {' and '.join(needs)}, which needs every gradient at once. Turn "
        f"that off to release them, or pass gradients='{'held' if held else 'coded'}' to say "
        "so.",
        MixprecWarning,
        stacklevel=user_stacklevel(),
    )
    return recipe.replace(gradients="held" if held else "coded")
