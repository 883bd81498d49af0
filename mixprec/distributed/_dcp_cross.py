"""An FSDP2 checkpoint of one recipe loaded under another: read as it was saved, then carried
into this model's shards by the rules the one-process path uses, and reported the same way.

Design (``docs/distributed.md``, "Checkpoints across recipes"):

* **What is carried.** An FSDP2 checkpoint holds fp32 master shards (O1-O3: FSDP's own fp32
  shards are the masters) or 16-bit shards stepped by an update mode (``"lean"``,
  ``Recipe("O3", update="kahan")``: weights, Kahan compensation, 16-bit / fp32 / coded states).
  Either loads into a model prepared with the other layout, another update mode or another
  state storage. Another 16-bit dtype, FP8 setting or number of losses is refused before
  anything is read (:func:`mixprec.distributed._dcp_checks.check_description`), as are another
  model and other parameter groups.
* **Read as saved.** The template asks DCP for every saved tensor in the dtype the index gives
  and by the rows the saved layout gives, shaped like this model's shards: another world size
  loads as it does for the same recipe. Everything is read into fresh tensors; the model and
  optimizer are written only after the whole read.
* **Carried by the one-process rules** (:mod:`mixprec._core.recipe_change`), which are
  elementwise and so apply to each rank's local shards as they are: fp32 masters -> 16-bit
  weights rounded to nearest, Kahan compensation their remainder, the rounding step count from
  0; 16-bit weights (+ compensation) -> fp32 master shards exactly; a compensation this update
  mode keeps no buffer for folded into the weight, none saved -> zero; 8/4-bit codes decoded to
  fp32 where fp32 master shards step (kept as codes under an update mode, whose next step
  stores them as its recipe does); fp32 and 16-bit states as torch loads them into fp32 master
  shards, and under an update mode in the dtype its recipe stores them in
  (``ModeUpdater._restored_dtype``, the one-process rule).
* **Put in by the same-recipe code.** The carried state is arranged in the update-mode layout
  (:mod:`mixprec.distributed._dcp_layout`) and committed by its ``commit_sharded``, so both
  loads write the model and optimizer the same way.
* **Reported** as one ``MixprecWarning`` and ``opt.last_load_report``, with the one-process
  path's lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mixprec._core.recipe_change import (
    announce,
    folded,
    master_value,
    nearest_weight,
    remainder,
    said_codes_decoded,
    said_masters_into_weights,
    said_mode_into_mode,
    said_weights_into_masters,
)
from mixprec.distributed import _dcp_checks as checks
from mixprec.distributed import _dcp_layout as layout

_LOW = (torch.float16, torch.bfloat16)
_F32 = "torch.float32"


def load(path: Path, index: Any, info: dict[str, Any], model: nn.Module, optimizer: Any) -> None:
    """Load the checkpoint at ``path`` (its DCP ``index`` and description ``info`` read and
    checked) of another recipe into ``model`` and ``optimizer``; a refused load changes
    nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saved = index.state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in saved.items() if hasattr(v, "properties")}
    shapes = {  # another depth is named first, by the parameters (nothing allocated)
        k: torch.empty(v.shape, dtype=dtypes.get(f"model.{k}", v.dtype), device="meta")
        for k, v in get_model_state_dict(model).items()
    }
    checks.check_against_index({"model": shapes}, index, path)
    if "layout_of" in info:  # 16-bit shards of an update mode
        template = layout.sharded_template(model, optimizer, info, dtypes)
    else:  # fp32 master shards, saved through torch's optimizer state dict
        template = _masters_template(model, saved, dtypes, path)
    checks.check_against_index(template, index, path)  # another model is named here
    keys = template.pop("blobs", {})
    read = {**template, **keys}  # the plain values at the top, keyed as DCP flattened them
    dcp.load(read, checkpoint_id=str(path))  # fresh tensors: the model is untouched
    blobs = {k: read[k] for k in keys}
    groups, own = (info["param_groups"], info["own"]) if "own" in info else _unflatten(blobs)
    checks.check_groups(optimizer, {"param_groups": groups, "own": own}, model, path)
    report: list[str] = []
    loaded, carried = _carry_weights(model, optimizer, template, info, report)
    loaded["optimizer"], carried["layout_of"], decoded = _carry_states(
        model, optimizer, template, info
    )
    report += said_codes_decoded(decoded)
    here = [{k for k in g if k != "params"} for g in optimizer.optimizer.param_groups]
    carried["param_groups"] = [
        {**{k: v for k, v in g.items() if k in keys}, "params": g["params"]}
        for g, keys in zip(groups, here)
    ]
    carried["own"] = own
    carried["extra_state"] = info.get("extra_state", {})
    layout.commit_sharded(model, optimizer, carried, loaded)
    if not report:  # fp32 master shards under both, or one update mode's state storage
        report = [
            f"recipe: {info.get('recipe')!r} -> {checks.describe(model, optimizer)['recipe']!r}: "
            "every state as saved, stored as this recipe stores it from its next step"
        ]
    announce(optimizer, report, stacklevel=5)  # the caller of load_checkpoint


# --------------------------------------------------------------------------- fp32 master shards
def _masters_template(
    model: nn.Module, saved: dict[str, Any], dtypes: dict[str, torch.dtype], path: Path
) -> dict[str, Any]:
    """Fresh tensors for an fp32-master-shard checkpoint (torch's optimizer state dict, keyed
    ``optimizer.state.<name>.<key>``): each state shaped like its parameter's shard or a scalar,
    in its saved dtype; the hyper-parameters and mixprec's own part (plain values) under
    ``blobs``, by their DCP keys."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_sd = {
        k: layout._fresh(v, dtypes.get(f"model.{k}"))
        for k, v in get_model_state_dict(model).items()
    }
    states: dict[str, dict[str, Any]] = {}
    for fqn, p in model.named_parameters():
        prefix, loc = f"optimizer.state.{fqn}.", layout._local(p)
        for key, md in saved.items():
            if not key.startswith(prefix) or not hasattr(md, "size"):
                continue
            k, size = key[len(prefix) :], tuple(md.size)
            if "." in k:
                raise ValueError(
                    f"The checkpoint {path} holds {key}, a nested optimizer state of {fqn}: not "
                    "a layout save_checkpoint writes. Nothing was loaded."
                )
            dtype = dtypes[key]  # another shape is named by check_against_index
            states.setdefault(fqn, {})[k] = (
                torch.empty((), dtype=dtype)  # torch keeps step counts on the CPU
                if size == ()
                else layout._like_param(torch.empty_like(loc, dtype=dtype), p)
            )
    blobs = {
        k: None
        for k, md in saved.items()
        if not hasattr(md, "size") and k.startswith(("optimizer.param_groups.", "mixprec."))
    }
    return {"model": model_sd, "optimizer": {"state": states}, "blobs": blobs}


def _unflatten(blobs: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:
    """(parameter groups, mixprec's own part) from their values keyed as DCP flattened them
    (``optimizer.param_groups.0.lr``, ``mixprec.scalers.0.scale``, ``mixprec.skipped_steps``)."""
    groups: dict[int, dict[str, Any]] = {}
    scalers: dict[int, dict[str, Any]] = {}
    own: dict[str, Any] = {}
    for key, value in blobs.items():
        parts = key.split(".")
        if parts[0] == "optimizer":
            groups.setdefault(int(parts[2]), {})[".".join(parts[3:])] = value
        elif parts[1] == "scalers":
            scalers.setdefault(int(parts[2]), {})[".".join(parts[3:])] = value
        else:
            own[".".join(parts[1:])] = value
    own["scalers"] = [scalers[i] for i in sorted(scalers)]
    own.setdefault("skipped_steps", 0)
    return [groups[i] for i in sorted(groups)], own


# --------------------------------------------------------------------------- weights
@torch.no_grad()
def _carry_weights(
    model: nn.Module, optimizer: Any, loaded: dict, info: dict, report: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The weights, compensation and update-mode state in this optimizer's layout (each
    parameter's local shard by the rules of the module docstring), with the report's lines."""
    updater = optimizer.updater
    comps_in = loaded.get("compensation", {})
    model_sd, comps = dict(loaded["model"]), {}
    into_masters = from_comps = into_weights = remainders = folds = False
    for fqn, p in model.named_parameters():
        saved = model_sd[fqn].to_local()
        c = comps_in[fqn].to_local() if fqn in comps_in else None
        mine = None if updater is None else updater.compensation.get(p)
        comp = None
        if p.dtype not in _LOW:  # an fp32 master shard (or a weight the recipe keeps fp32)
            new = master_value(saved, c)
            into_masters |= saved.dtype in _LOW
            from_comps |= c is not None
        elif saved.dtype not in _LOW:  # an fp32 master into a 16-bit weight
            new = nearest_weight(saved, p.dtype)
            comp = None if mine is None else remainder(saved, new, mine.dtype)
            into_weights, remainders = True, remainders or mine is not None
        else:
            new = saved if c is None or mine is not None else folded(saved, c)
            folds |= c is not None and mine is None
            comp = None if mine is None else (torch.zeros_like(mine) if c is None else c)
        model_sd[fqn] = layout._like_param(new.contiguous(), p)
        if comp is not None:
            comps[fqn] = layout._like_param(comp.contiguous(), p)
    saved_update = info.get("lean", {}).get("update")
    here_update = None if updater is None else updater.update
    if into_weights:
        low = next(p.dtype for p in model.parameters() if p.dtype in _LOW)
        report += said_masters_into_weights(low, here_update, remainders)
    if into_masters:
        report += said_weights_into_masters(from_comps)
    if "lean" in info and updater is not None and saved_update != here_update:
        report += said_mode_into_mode(saved_update, here_update, folds)
    carried: dict[str, Any] = {"compensation": sorted(comps)}
    if updater is not None:
        carried["lean"] = (  # one update mode into another keeps the saved count and seed
            {**info["lean"], "update": here_update}
            if "lean" in info
            else {"update": here_update, "seed": updater.seed, "steps": 0}
        )
    return {"model": model_sd, "compensation": comps}, carried


# --------------------------------------------------------------------------- optimizer states
@torch.no_grad()
def _carry_states(
    model: nn.Module, optimizer: Any, loaded: dict, info: dict
) -> tuple[dict[str, Any], dict[str, dict], set[str]]:
    """The optimizer states in this optimizer's storage, their layout for ``commit_sharded``,
    and the keys of the states decoded from codes (for the report)."""
    updater = optimizer.updater
    params = dict(model.named_parameters())
    saved_layout = info.get("layout_of")
    states: dict[str, Any] = {}
    lay_out: dict[str, dict] = {}
    decoded: set[str] = set()
    for fqn, st in loaded["optimizer"]["state"].items():
        p = params[fqn]
        stepped_16bit = updater is not None and p.dtype in _LOW
        out, lay = {}, {}
        for k, v in st.items():
            d = saved_layout[fqn][k] if saved_layout else _plain_layout(v)
            if d["kind"] == "codes" and stepped_16bit:  # codes until the next step stores them
                out[k], lay[k] = v, d
                continue
            if d["kind"] == "codes":  # fp32 where the inner optimizer steps fp32 shards
                q = layout.quantized_from_rows(v, layout._local(p).shape, d)
                out[k] = layout._like_param(q.dequantize(), p)
                lay[k] = {"kind": "shard", "dtype": _F32}
                decoded.add(k)
                continue
            if d["kind"] == "scalar":
                out[k], lay[k] = v, d
                continue
            local = v.to_local()
            want = (
                updater._restored_dtype(p, k, local) if stepped_16bit else p.dtype
            )  # as a step of this recipe stores it; torch's cast to an fp32 parameter's dtype
            out[k] = layout._like_param(local.to(want).contiguous(), p)
            lay[k] = {"kind": "shard", "dtype": str(want)}
        states[fqn], lay_out[fqn] = out, lay
    return {"state": states}, lay_out, decoded


def _plain_layout(v: Any) -> dict[str, Any]:
    """The layout entry of a state read from torch's optimizer state dict (fp32 master
    shards): a scalar, or a tensor sharded like its parameter."""
    if isinstance(v, Tensor) and not hasattr(v, "to_local"):
        return {"kind": "scalar", "dtype": str(v.dtype), "device": v.device.type}
    return {"kind": "shard", "dtype": str(v.dtype)}
