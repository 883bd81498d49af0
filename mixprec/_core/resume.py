"""Checkpoint layout and resume: mixprec's optimizer state where a plain torch load keeps it.

Design (``docs/design.md``, "Master weights and the optimizer"): mixprec's own state (exact
masters, compensation, loss scalers, counters) sits under ``param_groups[0]["mixprec"]``, which
torch's ``load_state_dict`` keeps, so state loaded into the plain optimizer before
:func:`mixprec.initialize` resumes bit for bit; it is checked against the model, and a stale
entry is dropped with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec._core._warnings import MixprecWarning

__all__ = [
    "MIXPREC_KEY",
    "drop_stale",
    "kahan_fp32",
    "merge_compensation",
    "pack_state_dict",
    "resume_carried",
    "split_state_dict",
    "state_steps",
    "take_state",
]

#: The key of mixprec's own state, in ``param_groups[0]`` of an optimizer state dict.
MIXPREC_KEY = "mixprec"


def pack_state_dict(inner: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``inner`` (a torch optimizer state dict) with ``own`` in its first parameter group."""
    groups = list(inner["param_groups"])
    if any(MIXPREC_KEY in g for g in groups):
        raise RuntimeError(
            f"The wrapped optimizer's param_groups hold a {MIXPREC_KEY!r} entry: a mixprec "
            "state dict was loaded into it directly, bypassing the masters and loss scalers "
            "(load it into the optimizer initialize returned), or it wraps a mixprec optimizer "
            "(wrap a plain torch optimizer)."
        )
    groups[0] = {**groups[0], MIXPREC_KEY: own}
    return {**inner, "param_groups": groups}


def split_state_dict(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(torch optimizer state dict, mixprec's own state or None)`` from the layout
    :func:`pack_state_dict` writes, or from a plain torch state dict. The input is not
    modified."""
    if isinstance(state_dict, dict) and MIXPREC_KEY in state_dict:
        raise KeyError(
            f"This optimizer state dict holds mixprec's state at the top level ({MIXPREC_KEY!r}), "
            "a layout mixprec does not read: its state lives in param_groups[0]"
            f"[{MIXPREC_KEY!r}]. Save it again with opt.state_dict() of the optimizer "
            "initialize returned."
        )
    if isinstance(state_dict, dict) and "state" in state_dict and "param_groups" in state_dict:
        own = None
        for g in state_dict["param_groups"]:
            own = g.get(MIXPREC_KEY, own)
        inner = dict(state_dict)
        inner["param_groups"] = [
            {k: v for k, v in g.items() if k != MIXPREC_KEY} if MIXPREC_KEY in g else g
            for g in state_dict["param_groups"]
        ]
        return inner, own
    keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else None
    raise KeyError(
        "Not an optimizer state dict: expected torch's layout ('state', 'param_groups', with "
        f"mixprec's state under param_groups[0][{MIXPREC_KEY!r}]); received "
        + (f"keys {keys}." if keys is not None else f"a {type(state_dict).__name__}.")
    )


def take_state(optimizer: Optimizer) -> dict[str, Any] | None:
    """Empty ``optimizer``'s state and take mixprec's entry out of its groups; return its state
    dict (None when it had neither), to be loaded into the wrapper once it is built (the masters
    then take the state, by index)."""
    if not optimizer.state and not any(MIXPREC_KEY in g for g in optimizer.param_groups):
        return None
    sd = optimizer.state_dict()
    optimizer.state.clear()
    for g in optimizer.param_groups:
        g.pop(MIXPREC_KEY, None)
    return sd


def state_steps(state: dict[Any, Any]) -> float | None:
    """The sum of the per-parameter ``step`` counts in an optimizer's ``state`` (None: none)."""
    steps = [float(st["step"]) for st in state.values() if isinstance(st, dict) and "step" in st]
    return sum(steps) if steps else None


def _count(steps: float | None) -> str:
    return "nothing (no state)" if steps is None else f"{steps:g}"


def drop_stale(inner: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any] | None:
    """``own``, or None (with a warning) when ``inner``'s state was stepped after it was written."""
    if own is None or "state_steps" not in own:  # built by a shim (Apex's FP16_Optimizer)
        return own
    now = state_steps(inner["state"])
    if now == own["state_steps"]:
        return own
    warnings.warn(
        f"The optimizer state's mixprec entry was written when the parameters' step counts "
        f"summed to {_count(own['state_steps'])}; they now sum to {_count(now)}: the optimizer "
        "was stepped without mixprec after loading it, so the entry's fp32 masters, Kahan "
        "compensation and loss scalers "
        "describe older weights and are ignored; the masters follow the model's weights. "
        "Resume from a checkpoint saved by the optimizer mixprec.initialize returned.",
        MixprecWarning,
        stacklevel=4,  # the caller of initialize or of opt.load_state_dict (under no_grad)
    )
    return None


@torch.no_grad()
def kahan_fp32(weight: Tensor, comp: Tensor) -> Tensor:
    """The fp32 value of a Kahan weight: ``w + c``, moved one fp32 ulp toward ``w`` where the
    sum lies half-way and would round to the other neighbour (see the module docstring)."""
    w = weight.detach().float()
    value = w + comp.float()
    off = value.to(weight.dtype) != weight.detach()
    if bool(off.any()):
        value = torch.where(off, torch.nextafter(value, w), value)
    return value


@torch.no_grad()
def merge_compensation(value: Tensor, weight: Tensor, comp: Tensor) -> Tensor:
    """The compensation for 16-bit ``weight`` that was just loaded with ``value`` (wider):
    ``comp`` where ``weight + comp`` is already the fp32 value the residual gives (a resume that
    restored it), elsewhere the residual of rounding ``value``."""
    w = weight.detach().float()
    residual = (value.float() - w).to(comp.dtype)
    return torch.where(w + comp.float() == w + residual.float(), comp, residual)


def _saved_masters(opt: Any, saved: list[Tensor]) -> tuple[list[Tensor], int]:
    """The saved masters, each replaced by the current one (built from the model's value) where
    it is neither that value nor rounds to it; and how many were replaced."""
    out, stale = [], 0
    for (p, m), s in zip(opt._pairs, saved):
        s = s.to(m.device)
        rounded = s.to(p.dtype).to(m.dtype)
        if s.shape == m.shape and (torch.equal(s, m) or torch.equal(rounded, m)):
            out.append(s)
        else:
            out.append(m.detach().clone())
            stale += 1
    return out, stale


def _saved_compensation(
    opt: Any, saved: list[Tensor | None], values: dict[int, Tensor]
) -> tuple[list[Tensor | None], int]:
    """The saved compensation where the model held 16-bit weights (the whole tensor), and per
    element where ``w + c`` is the fp32 value it held; elsewhere the residual in the buffer."""
    assert opt.updater is not None
    out: list[Tensor | None] = []
    stale = 0
    for p, s in zip(opt.updater.params(), saved):
        comp = opt.updater.compensation.get(p)
        if comp is None or s is None or s.shape != comp.shape:
            out.append(s)
            continue
        s = s.to(comp.device)
        value = values.get(id(p), p.detach())
        if torch.equal(value.to(p.dtype).to(value.dtype), value):  # a 16-bit checkpoint's
            out.append(s)
            continue
        w = p.detach().float()
        agree = w + s.float() == w + comp.float()
        out.append(torch.where(agree, s, comp))
        stale += int(not bool(agree.all()))
    return out, stale


def resume_carried(
    opt: Any,
    state_dict: dict[str, Any],
    values: dict[int, Tensor],
    scale_given: bool,
) -> None:
    """Load the state ``initialize`` took from the optimizer it wraps (a plain load before it)
    into ``opt``, the :class:`~mixprec._core.optimizer.MixedPrecisionOptimizer` built over it.

    ``values``: what the model held before the cast, by parameter id (masters already hold
    theirs). Saved masters and compensation are checked against the model (module docstring);
    ``scale_given``: the caller set the initial loss scale, which then needs no warning.
    """
    inner, own = split_state_dict(state_dict)
    if own is None:
        _warn_no_entry(opt, values, scale_given)
    else:
        own = drop_stale(inner, own)  # None: stale, and said so
    if own is None:
        opt.load_state_dict(inner)
        return
    if opt.saved_by_another_recipe(inner, own):  # carried as a load after initialize
        opt.load_state_dict(pack_state_dict(inner, own))
        return
    opt._check_own(own)
    own = dict(own)
    own["masters"], stale = _saved_masters(opt, own["masters"])
    updater = own.get("lean")
    if opt.updater is not None and updater is not None and updater.get("compensation") is not None:
        comps, stale_comps = _saved_compensation(opt, updater["compensation"], values)
        own["lean"] = {**updater, "compensation": comps}
        stale += stale_comps
    if stale:
        warnings.warn(
            f"mixprec.initialize: the optimizer state loaded before initialize holds fp32 "
            f"masters or Kahan compensation for {stale} parameter(s) that do not match the "
            "weights the model holds; those start from the model's weights. The model and "
            "optimizer state came from different checkpoints, or the optimizer was stepped "
            "without mixprec after loading. Load both from one checkpoint (the model's "
            "state_dict() or mixprec.fp32_state_dict(model, opt), and opt.state_dict()).",
            MixprecWarning,
            stacklevel=3,
        )
    opt.load_state_dict(pack_state_dict(inner, own))


def _warn_no_entry(opt: Any, values: dict[int, Tensor], given: bool) -> None:
    """A plain torch optimizer state: say what could not be restored from it, if anything."""
    lost = []
    if opt._pairs and all(torch.equal(m, m.to(p.dtype).to(m.dtype)) for p, m in opt._pairs):
        lost.append("the fp32 masters start from the model's 16-bit weights")
    comps = {} if opt.updater is None else opt.updater.compensation
    if comps and all(
        torch.equal(v, v.to(p.dtype).to(v.dtype)) for p in comps for v in [values.get(id(p), p)]
    ):
        lost.append("the Kahan compensation starts at zero")
    scaler = opt.slots[0].scaler if opt.slots else None
    if scaler is not None and scaler.dynamic and not given:
        lost.append(
            f"the loss scale starts at init_scale={scaler.scale:g} with fresh skip counters"
        )
    if not lost:
        return
    warnings.warn(
        "mixprec.initialize: the optimizer state loaded before initialize has no mixprec entry "
        "(it was saved by a plain torch optimizer, or by a mixprec version that kept it where "
        f"torch's load_state_dict drops it), so {'; '.join(lost)}. To resume a mixprec "
        "checkpoint exactly, load the optimizer state after initialize, into the optimizer it "
        "returns; for a torch.amp checkpoint pass init_scale=ckpt['scaler']['scale'].",
        MixprecWarning,
        stacklevel=4,
    )
