"""Apex's ``amp.initialize`` options, checked by Apex's rules and turned into a Recipe.

Design: Apex's frontend validates its option set (``frontend.py``: which properties each opt
level allows, with Apex's exception types and messages, which ported code may catch); mixprec
keeps those checks here and then states the result as one :class:`~mixprec.Recipe`, so the
shim trains exactly as ``mixprec.initialize`` does with that recipe.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

from mixprec._core.hardware import default_dtype
from mixprec._core.loss_scale import LossScaler
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec.compat.fp16_optimizer import FP16_Optimizer
from mixprec.recipe import LossScaling, Recipe

__all__ = ["ApexOptions", "check_level", "hint_dtype", "refuse_wrapped", "resolve_options"]

_LEVELS = ("O0", "O1", "O2", "O3")
_APEX_LOSS_SCALE = {"O0": 1.0, "O1": "dynamic", "O2": "dynamic", "O3": 1.0}
_APEX_MASTERS = {"O0": False, "O1": None, "O2": True, "O3": False}
_APEX_KEEP_BN = {"O0": None, "O1": None, "O2": True, "O3": False}


@dataclasses.dataclass(frozen=True)
class ApexOptions:
    """Apex's properties after its rules, defaults filled in."""

    level: str
    dtype: torch.dtype
    explicit: bool  # the dtype was chosen by the caller (no hint about bf16)
    cast_model_type: Any
    patch_torch_functions: Any
    keep_bn: bool | None
    masters: bool
    spec: str | float  # Apex's loss_scale property
    scaling: LossScaling | None
    cast_model_outputs: Any
    num_losses: int

    @property
    def leave_model(self) -> bool:
        """Apex leaves the model alone (no casts, no forward patch): masters and scaling only."""
        return self.cast_model_type is False or (
            self.level == "O1" and self.patch_torch_functions is False
        )

    def scaler(self) -> LossScaler:
        return LossScaler.from_spec(None) if self.scaling is None else self.scaling.scaler()

    def recipe(self) -> Recipe:
        """The recipe mixprec.initialize trains these options with."""
        fields: dict[str, Any] = dict(
            num_losses=self.num_losses,
            loss_scale=self.scaling,
            # Apex: O1 outputs keep the op's dtype, O2/O3 outputs are fp32
            outputs=self.cast_model_outputs
            if self.level == "O1"
            else self.cast_model_outputs or torch.float32,
        )
        if self.level in ("O2", "O3"):
            fields.update(keep_fp32="norms" if self.keep_bn else "none", masters=self.masters)
        return Recipe(self.level, None if self.level == "O0" else self.dtype, **fields)

    def properties(self) -> types.SimpleNamespace:
        """Apex's ``amp._amp_state.opt_properties``."""
        return types.SimpleNamespace(
            enabled=True,
            opt_level=self.level,
            cast_model_type=False
            if self.cast_model_type is False
            else {"O0": torch.float32, "O1": None}.get(self.level, self.dtype),
            patch_torch_functions=self.level == "O1" and self.patch_torch_functions is not False,
            keep_batchnorm_fp32=self.keep_bn if self.level in ("O2", "O3") else None,
            master_weights=self.masters if self.level != "O1" else None,
            loss_scale=self.spec,
            cast_model_outputs=self.cast_model_outputs,
            num_losses=self.num_losses,
        )


def check_level(opt_level: Any) -> str:
    """Apex's check and message (a RuntimeError), with names folding case: "o1" is "O1"."""
    level = opt_level.upper() if isinstance(opt_level, str) else opt_level
    if level not in _LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', "
            "'O2', 'O3' (any case). Note that in `O0`, `O1`, etc., the prefix O is the letter "
            "O, not the number zero."
        )
    return level


def _bool_or_none(name: str, value: Any) -> bool | None:
    if value in (None, True, False):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(
        f"{name} must be True, False, None or the strings 'True'/'False'; received {value!r}."
    )


def _check_o1(cast_model_type: Any, keep_bn: Any, master_weights: Any) -> None:
    """Apex's O1 rules: the model's weights stay fp32."""
    if cast_model_type not in (None, False, torch.float32):
        raise RuntimeError(
            "O1 inserts casts around Torch functions rather than model weights, "
            "so with O1, the model weights themselves should remain FP32. If "
            "you wish to cast the model to a different type, use opt_level="
            "'O2' or 'O3'. cast_model_type was " + str(cast_model_type)
        )
    if keep_bn is not None:
        raise RuntimeError(
            "With opt_level O1, batchnorm functions are automatically patched "
            "to run in FP32, so keep_batchnorm_fp32 should be None. "
            f"keep_batchnorm_fp32 was {keep_bn}"
        )
    if master_weights is not None:
        raise RuntimeError(
            "With opt_level O1, model weights remain FP32, so master_weights "
            f"should be None. master_weights was {master_weights}"
        )


def _model_dtype(level: str, cast_model_type: Any, dtype: Any) -> tuple[torch.dtype, bool]:
    """The 16-bit dtype (Apex: float16) and whether the caller chose it."""
    explicit = dtype is not None
    if cast_model_type in (torch.float16, torch.bfloat16):
        if level == "O0":
            raise RuntimeError(
                f"O0 trains in float32; use O2/O3 to cast the model to {cast_model_type}."
            )
        if dtype is not None and dtype != cast_model_type:
            raise ValueError(f"dtype={dtype} and cast_model_type={cast_model_type} disagree.")
        dtype, explicit = cast_model_type, True
    elif cast_model_type not in (None, False, torch.float32):
        raise ValueError(
            f"cast_model_type must be torch.float16, torch.bfloat16, torch.float32, "
            f"False or None; received {cast_model_type!r}."
        )
    return (torch.float16 if dtype is None else dtype), explicit


def _loss_scale_spec(loss_scale: Any, level: str) -> str | float:
    if loss_scale is None:
        return _APEX_LOSS_SCALE[level]
    if loss_scale == "dynamic":
        return "dynamic"
    try:
        return float(loss_scale)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be 'dynamic' or a number (as Apex: '128.0' works); "
            f"received {loss_scale!r}."
        ) from None


def _scaling(spec: str | float, bounds: tuple[Any, Any]) -> LossScaling | None:
    """Apex's scaler: dynamic with a scale window of 2000 and factor 2, starting at
    min(max_loss_scale, 2**16); a static scale; none for a scale of 1."""
    if spec != "dynamic":
        return None if spec == 1.0 else LossScaling(dynamic=False, init_scale=float(spec))
    min_loss_scale, max_loss_scale = bounds
    max_scale = float(max_loss_scale)
    min_scale = 1.0 if min_loss_scale is None else float(min_loss_scale)
    return LossScaling(
        init_scale=max(min(max_scale, 2.0**16), min_scale),
        growth_interval=2000,
        min_scale=min(min_scale, max_scale),
        max_scale=max_scale,
    )


def resolve_options(
    level: str,
    cast_model_type: Any,
    patch_torch_functions: Any,
    keep_batchnorm_fp32: Any,
    master_weights: Any,
    loss_scale: Any,
    cast_model_outputs: Any,
    num_losses: int,
    bounds: tuple[Any, Any],
    dtype: Any,
) -> ApexOptions:
    """Apex's consistency rules (its ``frontend.py``, same exceptions), then its defaults."""
    keep_bn = _bool_or_none("keep_batchnorm_fp32", keep_batchnorm_fp32)
    if level == "O1":
        _check_o1(cast_model_type, keep_bn, master_weights)
    if patch_torch_functions and level != "O1":
        raise RuntimeError(
            "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'."
        )
    low, explicit = _model_dtype(level, cast_model_type, dtype)
    spec = _loss_scale_spec(loss_scale, level)
    return ApexOptions(
        level=level,
        dtype=low,
        explicit=explicit,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_bn=_APEX_KEEP_BN[level] if keep_bn is None else keep_bn,
        masters=_APEX_MASTERS[level] if master_weights is None else bool(master_weights),
        spec=spec,
        scaling=_scaling(spec, bounds),
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
    )


def hint_dtype(opts: ApexOptions, device: torch.device) -> str | None:
    """The message that suggests bfloat16 where Apex's float16 default is the worse choice."""
    if opts.explicit or opts.dtype != torch.float16:
        return None
    if default_dtype(device) != torch.bfloat16:
        return None
    return (
        f"mixprec amp: using float16 as Apex does. On this {device.type} device "
        "bfloat16 is the better choice (as fast or faster, no loss scaling needed): "
        "pass dtype=torch.bfloat16 to amp.initialize (cast_model_type=torch.bfloat16 "
        "at O2/O3)."
    )


def refuse_wrapped(model_list: list[nn.Module], opt_list: list[Any]) -> None:
    """Apex's refusals: a parallel wrapper applied too early, an FP16_Optimizer, an optimizer
    passed twice."""
    for m in model_list:
        if isinstance(m, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise RuntimeError(  # noqa: TRY004 - Apex's exception type, kept for ported code
                "Incoming model is an instance of DataParallel/DistributedDataParall"
                "el. Parallel wrappers should only be applied to the model(s) AFTER "
                "the model(s) have been returned from amp.initialize."
            )
    for o in opt_list:
        if isinstance(o, FP16_Optimizer):
            raise RuntimeError(  # noqa: TRY004 - a misuse of the API, not a wrong type
                "An incoming optimizer is an FP16_Optimizer: amp.initialize takes "
                "the plain torch optimizer. Pass init_optimizer instead."
            )
        if isinstance(o, MixedPrecisionOptimizer):
            raise RuntimeError(  # noqa: TRY004 - Apex's exception type, kept for ported code
                "A given optimizer should only be passed through amp.initialize once."
            )
