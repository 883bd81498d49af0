"""Every rule on a :class:`~mixprec.Recipe`'s fields, checked in this one place at construction,
so that the entry points and the machinery below them trust a recipe; each error names the
field and the fix. Design: ``docs/design.md``, "The Recipe".
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._core.names import FLAGS, GRADIENTS, UPDATE_MODES
from mixprec._core.update.state_codes import FORMATS

__all__ = ["check_fields", "refuse_name"]

_UPDATES = ("auto", None, *UPDATE_MODES)
_LOW = (torch.float16, torch.bfloat16)
_CHOICES = {
    "compute": ("16-bit", "fp32"),
    "weights": ("16-bit", "fp32"),
    "keep_fp32": ("norms", "none"),
    "kernels": ("auto", "torch"),
    "gradients": GRADIENTS,
}
_STATE_KINDS = (torch.float32, torch.bfloat16, torch.float16, *FORMATS)

# what a broken rule says (beside the field and its value), where it says more than a line
_STATES = (
    "expected 'auto', '8-bit' or '4-bit' (block-wise codes), torch.float32 / bfloat16 / "
    "float16, or {state name: one of these} (e.g. {'exp_avg_sq': '8-bit'})."
)
_STORAGE_MASTERS = (
    "16-bit weights with fp32 compute (storage-only precision) save memory only without fp32 "
    "master weights, which this recipe keeps (masters=True). Allowed: compute='fp32' with an "
    "update mode (Recipe('lean', torch.bfloat16, compute='fp32'), or 'O3'), O0 for plain "
    "fp32, or compute='16-bit'."
)
_NO_MODE = (
    "update modes write 16-bit weights without fp32 masters; this recipe has {}. Use "
    "Recipe('O3', ...), or .replace(masters=False)."
)
_MODE_FIELD = (
    "applies to an update mode; set update='nearest', 'kahan' or 'stochastic' (16-bit weights "
    "without masters) as well."
)


def _fail(field: str, value: Any, why: str) -> None:
    raise ValueError(f"Recipe({field}={value!r}): {why}")


def _check_values(r: Any) -> None:
    for field, allowed in _CHOICES.items():
        if getattr(r, field) not in allowed:
            _fail(field, getattr(r, field), f"expected one of {allowed}.")
    for field in FLAGS:
        if not isinstance(getattr(r, field), bool):
            _fail(field, getattr(r, field), "expected True or False.")
    if r.update not in _UPDATES:
        _fail("update", r.update, f"expected one of {_UPDATES}.")
    if not _is_int(r.num_losses) or r.num_losses < 1:
        _fail("num_losses", r.num_losses, "expected an int >= 1 (losses backpropagated per step).")
    if r.update_seed is not None and not _is_int(r.update_seed):
        _fail("update_seed", r.update_seed, "expected an int or None.")
    if r.outputs is not None and not (
        isinstance(r.outputs, torch.dtype) and r.outputs.is_floating_point
    ):
        _fail("outputs", r.outputs, "expected a floating torch dtype or None.")
    if r.reduce_dtype not in ("auto", None, torch.float32, *_LOW):
        _fail("reduce_dtype", r.reduce_dtype, "expected 'auto', None or fp32 / bf16 / fp16.")
    _check_states(r.optimizer_states)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_states(states: Any) -> None:
    if isinstance(states, tuple):  # {state name: kind}, as its sorted items
        ok = all(isinstance(k, str) and v in _STATE_KINDS for k, v in states)
    else:
        ok = states == "auto" or states in _STATE_KINDS
    if not ok:
        _fail("optimizer_states", states, _STATES)


def _check_dtype(r: Any) -> None:
    fp32 = r.compute == "fp32" and r.weights == "fp32"
    if r.dtype is not None and r.dtype not in ((torch.float32,) if fp32 else _LOW):
        _refuse_dtype(r, fp32)


def _refuse_dtype(r: Any, fp32: bool) -> None:
    if fp32:
        _fail(
            "dtype",
            r.dtype,
            f"recipe {r.name!r} trains in float32, so the dtype would be ignored: drop it, "
            "or choose O1, O2 or O3 to train in it.",
        )
    _fail(
        "dtype",
        r.dtype,
        f"recipe {r.name!r} needs a 16-bit dtype (torch.bfloat16 or torch.float16). Use "
        "Recipe('O0') for float32 training.",
    )


def _check_storage(r: Any) -> None:
    cast = r.weights == "16-bit"
    if cast and r.compute == "fp32" and r.masters:
        _fail("compute", r.compute, _STORAGE_MASTERS)
    if r.keep_fp32 == "none" and not cast:
        _fail("keep_fp32", r.keep_fp32, "modules stay float32 anyway: weights='fp32'.")
    if r.masters and not cast:
        _fail("masters", True, "master weights back 16-bit weights; these weights are fp32.")
    if r.frozen_masters and not cast:
        _fail("frozen_masters", True, "applies to 16-bit weights; these weights are fp32.")
    if r.compute == "fp32":
        _check_fp32_compute(r)


def _check_fp32_compute(r: Any) -> None:
    """What applies only inside 16-bit compute, refused in a recipe that computes in fp32."""
    for field, value in (("fp8", r.fp8), ("fp32_inside", r.fp32_inside or None)):
        if value is not None:
            _fail(field, value, "applies inside 16-bit compute; this recipe computes in fp32.")
    if getattr(r.activations, "storage", None) == "16-bit":
        _fail(
            "activations",
            r.activations,
            "'16-bit' stores float32 saved tensors in the 16-bit dtype; this recipe "
            "computes in fp32. Use 'fp8', or a 16-bit recipe.",
        )


def _check_update(r: Any) -> None:
    modes = r.weights == "16-bit" and not r.masters  # where an update mode can run
    if r.update not in ("auto", None) and not modes:
        has = "master weights" if r.masters else "fp32 weights"
        _fail("update", r.update, _NO_MODE.format(has))
    if r.update is None or (r.update == "auto" and not modes):  # no update mode runs
        for field, default in (("optimizer_states", "auto"), ("update_seed", None)):
            if getattr(r, field) != default:
                _fail(field, getattr(r, field), _MODE_FIELD)
    if r.gradients in ("released", "coded"):
        _check_released(r, modes)


def _check_released(r: Any, modes: bool) -> None:
    what = "a released" if r.gradients == "released" else "a coded"
    if not modes or r.update is None:
        _fail(
            "gradients",
            r.gradients,
            f"{what} gradient is stepped by an update mode (16-bit weights, no masters, update "
            "not None). Use Recipe('lean'), or gradients='held'.",
        )
    if r.loss_scale not in ("auto", None) or r.num_losses > 1:
        _fail(
            "gradients",
            r.gradients,
            "a loss-scaled step must be skippable as a whole, and several losses need their "
            "gradients summed: both need the gradients held. Use gradients='auto' (held with "
            "loss scaling) or 'held'.",
        )


def check_fields(r: Any) -> None:
    """Raise ValueError naming the field and the fix for the first rule ``r`` breaks."""
    _check_values(r)
    _check_dtype(r)
    _check_storage(r)
    _check_update(r)


def refuse_name(name: Any, names: list[str]) -> None:
    """Raise for a recipe name that is none of ``names``, or no string."""
    if not isinstance(name, str):
        raise TypeError(
            f"A recipe's name is one of {names} or a mixprec.Policy; received {name!r} "
            f"(of type {type(name).__name__}). The dtype is the second argument: "
            "Recipe('O2', torch.bfloat16); a dtype as a policy: Recipe(mixprec.Policy(dtype))."
        )
    raise ValueError(
        f"Unknown recipe name {name!r}; expected one of {names} (levels: the letter "
        "O, not zero), or a recipe string such as 'O2 bf16 update=kahan'."
    )
