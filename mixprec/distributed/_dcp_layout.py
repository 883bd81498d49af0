"""The torch.distributed.checkpoint layout of an FSDP2 model and its mixprec optimizer.

Design (``docs/distributed.md``, "Checkpoints"):

* **Everything per shard is a DTensor sharded like its parameter.** Under an update mode
  (``"lean"``, ``Recipe("O3", update="kahan")``, ...) the 16-bit weights are FSDP2's dim-0
  shards and every per-element state -- the inner optimizer's moments (16-bit, fp32), Kahan
  compensation -- is a plain tensor of the local shard's shape. Each is saved as
  ``DTensor.from_local(state, mesh, param.placements, shape=param.shape)``: DCP then writes
  each rank's rows once, under the parameter's name, in the dtype it is held in (bf16 stays
  bf16). Keys: ``model.<fqn>`` (the 16-bit weights), ``optimizer.state.<fqn>.<key>``,
  ``compensation.<fqn>``.
* **Coded states by rows.** An 8- or 4-bit state (:mod:`mixprec._core.update.state_codes`) is two
  DTensors sharded by rows: ``<key>.codes`` (uint8, ``(rows, bytes per row)``; 4-bit codes are
  packed two per byte *within* a row, an odd row ending in half a byte) and ``<key>.scale``
  (fp32, ``(rows, blocks per row)``). Blocks never straddle rows, so any dim-0 sharding of the
  parameter reads its own rows' codes and scales. A state coded on some ranks and not on
  others (a shard under :data:`MIN_NUMEL` elements) is saved decoded, in fp32, on every rank;
  the next step reads the same values either way.
* **Replicated values once.** Scalar states (``step``, the same on every rank) are plain
  tensors, which DCP writes once; the hyper-parameters, the loss scalers and skip counters,
  the rounding step count, the layout above and a description of the recipe are one
  ``torch.save`` blob (``mixprec_meta``), written once.
* **Checked before anything is written** (:mod:`mixprec.distributed._dcp_checks`); then
  everything is read into fresh tensors, and only a complete read is copied into the model and
  optimizer (memory: one more copy of this rank's shard while loading).
* **World size.** The layout is keyed by name and sharded by rows, so it loads on another
  number of ranks: DCP reads each rank's new rows, coded states included (a block never
  straddles a row). A state saved in codes whose new shard is under :data:`MIN_NUMEL` is
  decoded at the load (:func:`commit_sharded`); one saved decoded whose new shard is large
  enough is held in fp32 until its next step codes it. ``docs/distributed.md``, "What stays
  exact when the number of ranks changes", has what was measured.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixprec._core.update.state_codes import BLOCK, FORMATS, QuantizedState, quantizable
from mixprec.distributed._dcp_checks import META_KEY, blob, describe

_LOW = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- DTensor helpers
def _like_param(local: Tensor, p: Any) -> Any:
    """``local`` (a tensor of ``p``'s local shape) as a DTensor sharded like ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _by_rows(local: Tensor, p: Any, width: int) -> Any:
    """A ``(local rows, width)`` tensor as a DTensor of ``(rows, width)`` sharded like ``p``."""
    from torch.distributed.tensor import DTensor

    rows = p.shape[0]
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=(rows, width), stride=(width, 1)
    )


def _check_rows(p: Any, fqn: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    if p.dim() == 0 or any(not isinstance(pl, Replicate) and pl != Shard(0) for pl in p.placements):
        raise NotImplementedError(
            f"save_checkpoint of an update mode needs parameters sharded along dim 0 (FSDP2's "
            f"default); {fqn} has placements {tuple(p.placements)}."
        )


def _row_shape(shape: torch.Size) -> tuple[int, int]:
    rows = shape[0] if len(shape) > 1 else 1
    return rows, (shape.numel() // rows if rows else 0)


def codes_by_row(q: QuantizedState) -> Tensor:
    """``q``'s codes as ``(rows, bytes per row)``; 4-bit codes repacked within rows where a
    row has an odd number of elements (else the flat packing already is per row)."""
    rows, length = _row_shape(q.shape)
    bits = FORMATS[q.fmt][0]
    if bits == 8:
        return q.codes.view(rows, length)
    if length % 2 == 0:
        return q.codes[: rows * length // 2].view(rows, length // 2)
    n = rows * length
    flat = torch.empty(n + n % 2, dtype=torch.uint8, device=q.codes.device)
    flat[0::2] = q.codes & 15
    flat[1::2] = q.codes >> 4
    per_row = torch.zeros(rows, length + 1, dtype=torch.uint8, device=q.codes.device)
    per_row[:, :length] = flat[:n].view(rows, length)
    return per_row[:, 0::2] | (per_row[:, 1::2] << 4)


def codes_from_rows(by_row: Tensor, shape: torch.Size, fmt: str) -> Tensor:
    """The inverse of :func:`codes_by_row`: the flat codes of a state of ``shape``."""
    rows, length = _row_shape(shape)
    if FORMATS[fmt][0] == 8 or length % 2 == 0:
        return by_row.reshape(-1).clone()
    nib = torch.empty(rows, 2 * by_row.shape[1], dtype=torch.uint8, device=by_row.device)
    nib[:, 0::2] = by_row & 15
    nib[:, 1::2] = by_row >> 4
    flat = nib[:, :length].reshape(-1)
    n = flat.numel()
    out = torch.empty(-(-n // 2), dtype=torch.uint8, device=by_row.device)
    out[: n // 2] = flat[0 : n - n % 2 : 2] | (flat[1 : n - n % 2 : 2] << 4)
    if n % 2:
        out[-1] = flat[-1]
    return out


def _code_widths(shape: torch.Size, fmt: str) -> tuple[int, int]:
    """(bytes per row, blocks per row) of a coded state of ``shape``."""
    _, length = _row_shape(shape)
    return -(-length * FORMATS[fmt][0] // 8), -(-length // BLOCK)


# --------------------------------------------------------------------------- update modes: save
def _named(model: nn.Module) -> dict[Any, str]:
    return {p: n for n, p in model.named_parameters()}


def _local(t: Any) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _coded_everywhere(inner: Any, params: list[Any]) -> set[tuple[int, str]]:
    """(id(param), key) of the states coded on every rank (one MIN all-reduce); a state coded
    on some ranks only is saved decoded. Every rank lists the same pairs in the same order."""
    pairs = [
        (p, k)
        for p in params
        for k, v in sorted(inner.state.get(p, {}).items())
        if isinstance(v, QuantizedState) or (isinstance(v, Tensor) and v.dim() > 0)
    ]
    flags = torch.tensor(
        [int(isinstance(inner.state[p][k], QuantizedState)) for p, k in pairs] or [1],
        dtype=torch.int32,
        device=_local(params[0]).device if params else "cpu",
    )
    if dist.is_initialized() and pairs:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {(id(p), k) for (p, k), f in zip(pairs, flags.tolist()) if f}


def _entries(p: Any, fqn: str, st: dict[str, Any], coded: set) -> tuple[dict, dict, dict]:
    """(what DCP saves, its layout, non-tensor values) of parameter ``p``'s state ``st``."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    lay: dict[str, Any] = {}
    ext: dict[str, Any] = {}
    for k, v in st.items():
        if isinstance(v, QuantizedState):
            if (id(p), k) in coded:
                by_row = codes_by_row(v)
                wc, ws = _code_widths(v.shape, v.fmt)
                out[k] = {
                    "codes": _by_rows(by_row, p, wc),
                    "scale": _by_rows(v.scale.view(by_row.shape[0], ws), p, ws),
                }
                lay[k] = {"kind": "codes", "fmt": v.fmt, "code_kind": v.kind}
                continue
            v = v.dequantize()
        if isinstance(v, DTensor):
            out[k], lay[k] = v, {"kind": "dtensor", "dtype": str(v.dtype)}
        elif isinstance(v, Tensor) and v.dim() == 0:
            out[k] = v  # torch keeps a step count on the CPU unless capturable / fused
            lay[k] = {"kind": "scalar", "dtype": str(v.dtype), "device": v.device.type}
        elif isinstance(v, Tensor) and isinstance(p, DTensor) and v.shape == _local(p).shape:
            out[k] = _like_param(v.contiguous(), p)
            lay[k] = {"kind": "shard", "dtype": str(v.dtype)}
        elif isinstance(v, Tensor):
            raise NotImplementedError(
                f"save_checkpoint: optimizer state {k!r} of {fqn} has shape {tuple(v.shape)}, "
                f"neither the shard's {tuple(_local(p).shape)} nor a scalar; DCP cannot place it."
            )
        else:
            ext[k] = v
    return out, lay, ext


def sharded_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The DCP state of a model stepped by an update mode (module docstring)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    updater, inner, names = optimizer.updater, optimizer.optimizer, _named(model)
    params = [p for g in inner.param_groups for p in g["params"]]
    coded = _coded_everywhere(inner, params)
    states: dict[str, Any] = {}
    info: dict[str, Any] = {**describe(model, optimizer), "layout_of": {}, "extra_state": {}}
    for p in params:
        if not inner.state.get(p):
            continue
        if isinstance(p, DTensor):
            _check_rows(p, names[p])
        states[names[p]], info["layout_of"][names[p]], ext = _entries(
            p, names[p], inner.state[p], coded
        )
        if ext:
            info["extra_state"][names[p]] = ext
    comps = {
        names[p]: _like_param(c, p)
        for p, c in updater.compensation.items()
        if isinstance(p, DTensor)
    }
    info["compensation"] = sorted(comps)
    info["param_groups"] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in inner.param_groups
    ]
    info["own"] = {  # the replicated part of mixprec_state_dict (no masters under update modes)
        "masters": [],
        "scalers": [s.scaler.state_dict() for s in optimizer.slots],
        "skipped_steps": optimizer.skipped_steps,
        "step_skipped": optimizer.step_skipped,
    }
    info["lean"] = {"update": updater.update, "seed": updater.seed, "steps": updater.steps}
    return {
        "model": get_model_state_dict(model),
        "optimizer": {"state": states},
        "compensation": comps,
        META_KEY: blob(info),
    }


# --------------------------------------------------------------------------- update modes: load
def _fresh(v: Any, dtype: torch.dtype | None = None) -> Any:
    """An empty tensor like ``v`` (a DTensor: sharded like it), in ``dtype`` if given."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return DTensor.from_local(
            torch.empty_like(v.to_local(), dtype=dtype),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=v.shape,
            stride=v.stride(),
        )
    return torch.empty_like(v, dtype=dtype) if isinstance(v, Tensor) else v


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def sharded_template(
    model: nn.Module,
    optimizer: Any,
    info: dict[str, Any],
    dtypes: dict[str, torch.dtype] | None = None,
) -> dict[str, Any]:
    """Fresh tensors, shaped like this model's shards, for what ``info`` says was saved; the
    weights, buffers and compensation in this model's dtypes, or as ``dtypes`` (DCP keys, e.g.
    ``model.0.weight``) says they were saved (a checkpoint of another recipe)."""
    dtypes = dtypes or {}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    params = dict(model.named_parameters())
    missing = sorted(
        {*info["layout_of"], *info["compensation"]} - set(params)
    )  # another depth is named by check_against_index; this is a corrupt description
    if missing:
        raise ValueError(f"The checkpoint's optimizer state names unknown parameters {missing}.")
    states: dict[str, Any] = {}
    for fqn, lay in info["layout_of"].items():
        p = params[fqn]
        loc = _local(p)
        out: dict[str, Any] = {}
        for k, d in lay.items():
            if d["kind"] == "codes":
                wc, ws = _code_widths(loc.shape, d["fmt"])
                rows = _row_shape(loc.shape)[0]
                out[k] = {
                    "codes": _by_rows(
                        torch.empty(rows, wc, dtype=torch.uint8, device=loc.device), p, wc
                    ),
                    "scale": _by_rows(
                        torch.empty(rows, ws, dtype=torch.float32, device=loc.device), p, ws
                    ),
                }
            elif d["kind"] == "scalar":
                cpu = d.get("device") == "cpu"
                out[k] = torch.empty(
                    (), dtype=_dtype(d["dtype"]), device="cpu" if cpu else loc.device
                )
            else:
                out[k] = _like_param(torch.empty_like(loc, dtype=_dtype(d["dtype"])), p)
        states[fqn] = out
    buffers = optimizer.updater.compensation if optimizer.updater is not None else {}
    comps = {
        fqn: _like_param(
            torch.empty_like(buffers.get(p, _local(p)), dtype=dtypes.get(f"compensation.{fqn}")),
            p,
        )
        for fqn in info["compensation"]
        for p in [params[fqn]]
    }
    model_sd = {
        k: _fresh(v, dtypes.get(f"model.{k}")) for k, v in get_model_state_dict(model).items()
    }
    return {"model": model_sd, "optimizer": {"state": states}, "compensation": comps}


def quantized_from_rows(v: dict[str, Any], shape: torch.Size, d: dict[str, Any]) -> QuantizedState:
    """The coded state of a local shard of ``shape`` from its loaded ``codes`` and ``scale``
    (DTensors by rows) and its layout entry ``d``."""
    q = QuantizedState(
        codes_from_rows(v["codes"].to_local(), shape, d["fmt"]),
        v["scale"].to_local().reshape(-1).clone(),
        torch.Size(shape),
        d["fmt"],
        d["code_kind"],
    )
    assert q.scale.numel() == _row_shape(shape)[0] * _code_widths(shape, d["fmt"])[1]
    return q


@torch.no_grad()
def commit_sharded(
    model: nn.Module, optimizer: Any, info: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """Put a completely read checkpoint into the model and optimizer (bit for bit)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    inner, updater = optimizer.optimizer, optimizer.updater
    set_model_state_dict(model, loaded["model"])
    inner.state.clear()
    for fqn, lay in info["layout_of"].items():
        p = params[fqn]
        local_states = updater is not None and p.dtype in _LOW  # stepped through its shard
        st: dict[str, Any] = {}
        for k, d in lay.items():
            v = loaded["optimizer"]["state"][fqn][k]
            if d["kind"] == "codes":
                shape = _local(p).shape
                q = quantized_from_rows(v, shape, d)
                st[k] = q if quantizable(torch.empty(shape, device="meta")) else q.dequantize()
            elif d["kind"] == "scalar":
                st[k] = v
            elif d["kind"] == "dtensor" or not local_states:
                st[k] = v if isinstance(v, DTensor) else _like_param(v, p)
            else:
                st[k] = v.to_local()
        st.update(info["extra_state"].get(fqn, {}))
        inner.state[p] = st
    for g, saved in zip(inner.param_groups, info["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                g[k] = v
    if updater is not None:
        comps = {params[f]: loaded["compensation"][f] for f in info["compensation"]}
        updater.load_state_dict(
            {
                **info["lean"],
                "compensation": [
                    None if p not in comps else comps[p].to_local() for p in updater.params()
                ],
            }
        )
    own = info["own"]
    for slot, sd in zip(optimizer.slots, own["scalers"]):
        slot.scaler.load_state_dict(sd)
        slot.pending.clear()
    optimizer.skipped_steps = int(own["skipped_steps"])
    optimizer.step_skipped = bool(own.get("step_skipped", False))
