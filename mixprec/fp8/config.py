"""``FP8Config``: which FP8 recipe, on which layers, chosen for which GPU.

One frozen dataclass under one keyword (``fp8=``). Recipes are data (:data:`RECIPES`, each a
:class:`Scaling`): torchao's tensorwise (e4m3 operands, e5m2 gradients, one scale per tensor)
and rowwise (e4m3, a power-of-2 scale per row) recipes, scaled dynamically from the current
amax; ``all_gather`` says what FSDP2 gathers for an FP8 weight. Design: ``docs/design.md``,
"One training step through the code"; the user's page is ``docs/fp8.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.fp8.quantization import E4M3, E5M2

__all__ = ["RECIPES", "TARGETS", "FP8Config", "Scaling", "as_fp8_config"]


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How one FP8 recipe scales and quantizes the operands of a Linear's three GEMMs.

    Attributes:
        name: ``"tensorwise"`` or ``"rowwise"``.
        grad_dtype: FP8 format of the output gradient (inputs and weights are always e4m3).
        rowwise: one scale per row of each operand along the GEMM's contraction dimension,
            instead of one per tensor.
        power_of_2: scales rounded down to a power of two (exact rescaling).
    """

    name: str
    grad_dtype: torch.dtype
    rowwise: bool
    power_of_2: bool
    fwd_dtype: torch.dtype = E4M3


RECIPES: dict[str, Scaling] = {
    "tensorwise": Scaling("tensorwise", grad_dtype=E5M2, rowwise=False, power_of_2=False),
    "rowwise": Scaling("rowwise", grad_dtype=E4M3, rowwise=True, power_of_2=True),
}

#: GPUs whose speed the automatic layer choice can be made for (see :mod:`.choice`).
TARGETS = ("h100", "h200", "b200", "l40s")
_LAYERS = ("auto", "all")
_GATHERS = ("auto", "fp8", "16-bit")

LayerSelector = str | Callable[[str, nn.Module], bool]


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """FP8 matmuls for chosen ``nn.Linear`` layers.

    Args:
        recipe: ``"tensorwise"`` (e4m3 forward operands, e5m2 gradients, one scale per tensor;
            default) or ``"rowwise"`` (e4m3, per-row power-of-2 scales).
        layers: ``"auto"`` (default): a Linear runs in FP8 where its shape is predicted to be
            faster on the target GPU and its numbers survive the cast, decided from the first
            batch it sees (or from :func:`mixprec.fp8.fp8_plan`); ``"all"``: every Linear whose
            shape CUDA's FP8 kernels accept (in and out features multiples of 16), the output
            head excepted; or a predicate ``(name, module) -> bool`` (a :class:`FP8Plan` is
            one).
        target: the GPU the speed side of ``"auto"`` is judged for, one of :data:`TARGETS`;
            None: the CUDA device the model is on, or an H100 on a CPU, so a CPU run chooses
            the layers a GPU run would.
        all_gather: the dtype FSDP2 all-gathers the weights of FP8 layers in: ``"auto"``
            (default): FP8 for tensorwise, 16 bits for rowwise; ``"fp8"`` (tensorwise only);
            ``"16-bit"``. Without FSDP2 it changes nothing (``docs/distributed.md``).

    Example:
        >>> FP8Config(recipe="rowwise", layers="all")
        FP8Config(recipe='rowwise', layers='all', target=None, all_gather='auto')
    """

    recipe: str = "tensorwise"
    layers: LayerSelector = "auto"
    target: str | None = None
    all_gather: str = "auto"

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(
                f"FP8Config(recipe={self.recipe!r}): unknown recipe; expected one of "
                f"{sorted(RECIPES)}."
            )
        if isinstance(self.layers, str):
            if self.layers not in _LAYERS:
                raise ValueError(
                    f"FP8Config(layers={self.layers!r}): expected 'auto', 'all' or a "
                    "predicate (name, module) -> bool, e.g. lambda name, m: 'mlp' in name."
                )
        elif not callable(self.layers):
            raise TypeError(
                f"FP8Config(layers=...) takes 'auto', 'all' or a callable (name, module) -> "
                f"bool; received {type(self.layers).__name__}."
            )
        if self.target is not None and self.target not in TARGETS:
            raise ValueError(
                f"FP8Config(target={self.target!r}): expected None (the device trained on) "
                f"or one of {list(TARGETS)}."
            )
        if self.all_gather not in _GATHERS:
            raise ValueError(
                f"FP8Config(all_gather={self.all_gather!r}): expected one of {list(_GATHERS)}."
            )
        if self.all_gather == "fp8" and self.scaling.rowwise:
            raise ValueError(
                f"FP8Config(recipe={self.recipe!r}, all_gather='fp8'): rowwise scales differ "
                "per row and per GEMM, so no one FP8 copy of a weight serves its GEMMs; rowwise "
                "weights are all-gathered in 16 bits (all_gather='auto' or '16-bit')."
            )

    @property
    def gathers_fp8(self) -> bool:
        """Whether FSDP2 all-gathers the weights of this config's FP8 layers in FP8."""
        return self.all_gather == "fp8" or (self.all_gather == "auto" and not self.scaling.rowwise)

    @property
    def scaling(self) -> Scaling:
        """The :class:`Scaling` of the recipe named by ``recipe``."""
        return RECIPES[self.recipe]


def as_fp8_config(fp8: Any) -> FP8Config | None:
    """Normalise an ``fp8=`` argument: None/False -> None; True -> the default config; a
    recipe name -> that recipe with automatic layers; an :class:`FP8Config` as given."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return FP8Config()
    if isinstance(fp8, str):
        if fp8 not in RECIPES:
            raise ValueError(
                f"fp8={fp8!r}: expected True, a recipe name ({', '.join(map(repr, RECIPES))}) "
                "or mixprec.FP8Config(recipe=..., layers=...)."
            )
        return FP8Config(recipe=fp8)
    if isinstance(fp8, FP8Config):
        return fp8
    raise TypeError(
        f"fp8= takes True, a recipe name ({', '.join(map(repr, RECIPES))}) or "
        f"mixprec.FP8Config; received {type(fp8).__name__}."
    )
