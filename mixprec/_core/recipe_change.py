"""A checkpoint of one recipe loaded under another: each saved state carried into what this
optimizer holds, by one rule per state, and a report of what changed.

Design: a saved optimizer state dict says how the weights were held (fp32 masters, or 16-bit
weights with an update mode and, under Kahan, a compensation buffer) and how each optimizer
state was stored (fp32, 16-bit, 8/4-bit codes). Where the loading optimizer holds them
otherwise, :func:`adapt` rewrites mixprec's saved entry into the loader's layout before
anything is checked or written; the rules:

* fp32 masters into 16-bit weights without masters: each weight is its master rounded to
  nearest and, under Kahan, its compensation is the remainder (``master - weight``, in the
  compensation's dtype); the update mode's rounding step count starts at 0;
* 16-bit weights into fp32 masters: each master is the weight plus its saved compensation,
  widened exactly;
* one update mode into another: a compensation the loader keeps no buffer for is folded into
  the weight (``weight + compensation`` rounded to nearest); a Kahan loader without a saved
  buffer starts from zero compensation (the weight is then exact as it is);
* loss scaling: where the checkpoint scaled its losses and this recipe does not (fp16 into
  bf16), or the other way, each loss keeps this recipe's own scaler;
* optimizer states: fp32 and 16-bit values are loaded as torch loads them and stored as the
  loader's recipe stores them (``ModeUpdater.restore_state_dtypes``); 8/4-bit codes
  are decoded to fp32 where the loader steps fp32 masters.

A rule that adds a saved compensation to the model's 16-bit weight holds in either load
order: where the model's state dict is loaded after the optimizer's (before any step), its
16-bit load completes the value (:func:`carried_value`, read by
:class:`~mixprec._core.fp32_values.LoadRefresh`).

What it cannot carry (another model, other parameter counts or shapes) is refused by the
checks that follow, as for a checkpoint of the same recipe. The report goes out as one
:class:`~mixprec._core._warnings.MixprecWarning` and stays on the optimizer as
``last_load_report`` (a list of lines). ``docs/training.md``, "Checkpoints across recipes".

Each rule is elementwise, so the functions that compute it (:func:`nearest_weight`,
:func:`remainder`, :func:`master_value`, :func:`folded`) and the report's lines (``said_*``)
serve whole tensors here and one rank's shards alike: an FSDP2 checkpoint of another recipe
(:mod:`mixprec.distributed._dcp_cross`) is carried by the same functions.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from mixprec._core._warnings import MixprecWarning
from mixprec._core.update.state_codes import QuantizedState, fp32_optimizer_state_dict

__all__ = [
    "adapt",
    "announce",
    "carried_value",
    "folded",
    "master_value",
    "nearest_weight",
    "remainder",
    "said_codes_decoded",
    "said_masters_into_weights",
    "said_mode_into_mode",
    "said_weights_into_masters",
]

_LOW = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- the rules
def nearest_weight(master: Tensor, dtype: torch.dtype) -> Tensor:
    """A 16-bit weight from its fp32 master: rounded to nearest."""
    return master.to(dtype)


def remainder(master: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """Kahan compensation from a master and its rounded weight: ``master - weight``."""
    return (master.float() - weight.float()).to(dtype)


def master_value(weight: Tensor, comp: Tensor | None = None) -> Tensor:
    """An fp32 master from a weight and its saved compensation (or none): widened exactly."""
    value = weight.detach().float()
    return value if comp is None else value + comp.to(value.device).float()


def folded(weight: Tensor, comp: Tensor) -> Tensor:
    """A weight with a compensation the loader keeps no buffer for folded in (nearest)."""
    return (weight.detach().float() + comp.to(weight.device).float()).to(weight.dtype)


def said_masters_into_weights(low: torch.dtype, update: str | None, comps: bool) -> list[str]:
    """The report's lines for fp32 masters carried into ``low`` weights stepped by ``update``
    (None: no update mode), with Kahan compensation from their remainders where ``comps``."""
    lines = [f"weights: fp32 masters -> {low} weights (nearest)"]
    if update is None:
        return lines
    if comps:
        lines.append("Kahan compensation: the masters' remainder (master - weight)")
    return [*lines, f"update: fp32 masters -> update={update!r}, rounding count from 0"]


def said_weights_into_masters(comps: bool) -> list[str]:
    how = " + compensation" if comps else ""
    return [f"weights: 16-bit weights{how} -> fp32 masters (exact)"]


def said_codes_decoded(keys: set[str]) -> list[str]:
    return [f"{k}: codes -> fp32 (their decoded values)" for k in sorted(keys)]


def said_mode_into_mode(saved: str | None, target: str | None, folds: bool) -> list[str]:
    lines = [f"update: {saved!r} -> {target!r}"]
    if folds:
        lines.append("Kahan compensation: folded into the weights (weight + compensation, nearest)")
    return lines


# --------------------------------------------------------------------------- one process
def adapt(opt: Any, inner: dict[str, Any], own: dict[str, Any]) -> tuple[dict, dict, list, list]:
    """``(inner, own, writes, report)``: the saved state in ``opt``'s layout, the weight writes
    to make once it is loaded (``(param, fp32 value)`` pairs, rounded into the parameter) and
    the report's lines (empty: the checkpoint has ``opt``'s layout already)."""
    saved_masters = own.get("masters", [])
    saved_mode = own.get("lean")
    writes: list[tuple[Tensor, Tensor]] = []
    report: list[str] = []
    if saved_masters and not opt._pairs and _low_params(opt):
        own, writes = _masters_into_weights(opt, own, report)
    elif not saved_masters and opt._pairs and "masters" in own:
        inner, own = _weights_into_masters(opt, inner, own, report)
    elif saved_mode is not None and not saved_masters and not opt._pairs:
        own, writes = _mode_into_mode(opt, own, report)
    return inner, _scalers(opt, own, report), writes, report


def announce(opt: Any, report: list[str], stacklevel: int = 4) -> None:
    """Keep ``report`` on ``opt`` and say it once, as one warning (``stacklevel`` as
    ``warnings.warn`` takes it, counted from this function)."""
    opt.last_load_report = report
    if report:
        warnings.warn(
            "This checkpoint was saved under another recipe; its state was carried over:\n  "
            + "\n  ".join(report),
            MixprecWarning,
            stacklevel=stacklevel,
        )


def _low_params(opt: Any, own: dict | None = None) -> list[Tensor]:
    """The parameters of ``opt`` that the saved masters of ``own`` belong to (by their saved
    positions in parameter-group order), or every 16-bit one."""
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    positions = (own or {}).get("master_positions")
    if positions is None or any(i >= len(params) for i in positions):
        return [p for p in params if p.dtype in _LOW]
    return [params[i] for i in positions]


def _masters_into_weights(opt: Any, own: dict, report: list[str]) -> tuple[dict, list]:
    params, masters = _low_params(opt, own), own["masters"]
    if len(params) != len(masters) or any(
        p.shape != m.shape or p.dtype not in _LOW for p, m in zip(params, masters)
    ):
        return own, []  # another model: the count check that follows refuses it
    updater = opt.updater
    writes = list(zip(params, masters))
    low = params[0].dtype
    if updater is None:
        report += said_masters_into_weights(low, None, False)
        return {**own, "masters": []}, writes
    comps, by_param = [], {id(q): m for q, m in writes}
    for p in updater.params():
        mine, master = updater.compensation.get(p), by_param.get(id(p))
        if mine is None or master is None:  # no buffer; or a weight the model's load sets
            comps.append(None if mine is None else mine.clone())  # (and its remainder)
            continue
        comps.append(remainder(master, nearest_weight(master, p.dtype), mine.dtype))
    report += said_masters_into_weights(low, updater.update, any(c is not None for c in comps))
    mode = {"update": updater.update, "seed": updater.seed, "compensation": comps, "steps": 0}
    return {**own, "masters": [], "lean": mode}, writes


def _weights_into_masters(opt: Any, inner: dict, own: dict, report: list[str]) -> tuple:
    mode = own.get("lean") or {}
    saved_comps = mode.get("compensation") or []
    ids = [i for g in inner["param_groups"] for i in g["params"]]
    groups = [p for g in opt.optimizer.param_groups for p in g["params"]]
    if len(ids) != len(groups) or (saved_comps and len(saved_comps) != len(groups)):
        return inner, own  # another model: the checks that follow refuse it
    by_master = {id(m): p for p, m in opt._pairs}
    masters = []
    for pos, q in enumerate(groups):
        p = by_master.get(id(q))
        if p is None:
            continue
        comp = saved_comps[pos] if saved_comps else None
        masters.append(master_value(p, comp))
        if comp is not None:
            _pend(opt, p, comp)
    report += said_weights_into_masters(any(c is not None for c in saved_comps))
    decoded = {
        k for st in inner["state"].values() for k, v in st.items() if QuantizedState.is_dict(v)
    }
    report += said_codes_decoded(decoded)
    own = {k: v for k, v in own.items() if k != "lean"}
    return fp32_optimizer_state_dict(inner), {**own, "masters": masters}


def _mode_into_mode(opt: Any, own: dict, report: list[str]) -> tuple[dict, list]:
    saved, updater = own["lean"], opt.updater
    target = None if updater is None else updater.update
    if saved.get("update") == target:
        return own, []
    comps = saved.get("compensation") or []
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    if len(comps) != len(params):
        return own, []  # another model: the checks that follow refuse it
    writes, new = [], []
    for p, c in zip(params, comps):
        mine = None if updater is None else updater.compensation.get(p)
        if c is not None and mine is None:  # folded into the weight
            writes.append((p, folded(p, c)))
            _pend(opt, p, c)
        new.append(None if mine is None else (c if c is not None else torch.zeros_like(mine)))
    report += said_mode_into_mode(saved.get("update"), target, bool(writes))
    if updater is None:
        return {k: v for k, v in own.items() if k != "lean"}, writes
    return {**own, "lean": {**saved, "update": target, "compensation": new}}, writes


def _pend(opt: Any, p: Tensor, comp: Tensor) -> None:
    """Keep ``comp`` for a 16-bit load of ``p`` into the model that may follow, until the
    next step (``MixedPrecisionOptimizer.step`` drops what is left)."""
    opt.__dict__.setdefault("_carry_pending", {})[id(p)] = comp


def carried_value(opt: Any, p: Tensor, src: Tensor) -> Tensor | None:
    """The fp32 value of ``p`` once the model's ``src`` is loaded into it after a checkpoint of
    another recipe: ``src + compensation`` where that load (16-bit, before any step) carries
    one, else None (an fp32 load is a value of its own)."""
    comp = opt.__dict__.get("_carry_pending", {}).pop(id(p), None)
    if comp is None or src.dtype != p.dtype or src.dtype not in _LOW:
        return None
    return master_value(src.to(p.device), comp)


def _scalers(opt: Any, own: dict, report: list[str]) -> dict:
    """Keep this optimizer's loss scalers where the saved ones are of the other kind (enabled
    or not): a bf16 recipe does not run an fp16 checkpoint's dynamic scale."""
    saved = own.get("scalers") or []
    if len(saved) != len(opt.slots):
        return own  # another model or loss count: the checks that follow refuse it
    kept = [s.scaler.state_dict() for s in opt.slots]
    if all(bool(a.get("enabled")) == b["enabled"] for a, b in zip(saved, kept)):
        return own
    said = ", ".join(f"{a.get('scale', 1.0):g}" for a in saved)
    mine = "disabled" if not kept[0]["enabled"] else f"init_scale={kept[0]['scale']:g}"
    report.append(f"loss scale: saved {said} -> this recipe's own ({mine})")
    return {**own, "scalers": kept}
