"""The torch.distributed.checkpoint layout of an FSDP2 model and its mixprec optimizer.

Design (issue 41; ``docs/distributed.md``, "Checkpoints"):

* **Everything per shard is a DTensor sharded like its parameter.** Under an update mode
  (``"lean"``, ``Recipe("O3", update="kahan")``, ...) the 16-bit weights are FSDP2's dim-0
  shards and every per-element state -- the inner optimizer's moments (16-bit, fp32), Kahan
  compensation -- is a plain tensor of the local shard's shape. Each is saved as
  ``DTensor.from_local(state, mesh, param.placements, shape=param.shape)``: DCP then writes
  each rank's rows once, under the parameter's name, in the dtype it is held in (bf16 stays
  bf16). Keys: ``model.<fqn>`` (the 16-bit weights), ``optimizer.state.<fqn>.<key>``,
  ``compensation.<fqn>``.
* **Coded states by rows.** An 8- or 4-bit state (:mod:`mixprec._core.state_codes`) is two
  DTensors sharded by rows: ``<key>.codes`` (uint8, ``(rows, bytes per row)``; 4-bit codes are
  packed two per byte *within* a row, an odd row ending in half a byte) and ``<key>.scale``
  (fp32, ``(rows, blocks per row)``). Blocks never straddle rows, so any dim-0 sharding of the
  parameter reads its own rows' codes and scales. A state coded on some ranks and not on
  others (a shard under :data:`MIN_NUMEL` elements) is saved decoded, in fp32, on every rank;
  the next step reads the same values either way.
* **Replicated values once.** Scalar states (``step``), the hyper-parameters, the loss
  scalers and skip counters, the rounding step count and a description of the recipe are one
  ``torch.save`` blob (``mixprec_meta``), which DCP writes once.
* **Checked before anything is written.** ``load`` reads DCP's index first: a data file
  shorter than the index says (a save cut off mid-write) or a missing index, another recipe or
  dtype (the blob's description), another set of parameters or shapes (another depth) are
  refused with what differs; then everything is read into fresh tensors, and only a complete
  read is copied into the model and optimizer (memory: one more copy of this rank's shard
  while loading).
* **World size.** The layout is keyed by name and sharded by rows, so it can be resharded;
  until a run checks that it resumes correctly on another number of ranks, an update-mode
  checkpoint loads on the world size that saved it, and another one is refused.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixprec._core.state_codes import BLOCK, FORMATS, QuantizedState, quantizable

META_KEY = "mixprec_meta"
FORMAT = "mixprec-dcp/1"
RECIPE_ATTR = "_mixprec_fsdp_recipe"  # (recipe, 16-bit dtype), set by initialize_fsdp
#: recipe fields that decide what a checkpoint holds: loading across them is refused
STATE_FIELDS = (
    "name",
    "compute",
    "weights",
    "masters",
    "keep_fp32",
    "update",
    "optimizer_states",
    "update_seed",
    "fp8",
    "num_losses",
)
_LOW = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- description
def describe(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What the checkpoint of ``model`` holds, compared on load."""
    recipe, low = model.__dict__.get(RECIPE_ATTR, (None, None))
    lean = getattr(optimizer, "lean", None)
    return {
        "format": FORMAT,
        "layout": "16-bit shards" if lean is not None else "fp32 master shards",
        "recipe": None if recipe is None else str(recipe),
        "fields": {} if recipe is None else {f: _word(getattr(recipe, f)) for f in STATE_FIELDS},
        "dtype": None if low is None else str(low),
        "update": None if lean is None else lean.update,
        "state_dtype": None if lean is None else _word(lean.state_dtype),
        "world_size": _world_size(model),
    }


def _world_size(model: nn.Module) -> int:
    """The number of ranks the parameters are sharded over (their mesh's size)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return dist.get_world_size() if dist.is_initialized() else 1


def _word(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def check_description(saved: dict[str, Any], here: dict[str, Any], path: Path) -> None:
    """Refuse another format, recipe, dtype, update mode or (16-bit shards) world size."""
    if saved.get("format") != FORMAT:
        raise ValueError(
            f"{path} holds a {saved.get('format')!r} checkpoint; this version reads {FORMAT!r}."
        )
    diffs = []
    fields_s, fields_h = saved.get("fields") or {}, here.get("fields") or {}
    # with both recipes known their fields name what differs; else what the optimizer shows
    keys = ["layout", "dtype"] + ([] if fields_s and fields_h else ["update", "state_dtype"])
    for key in keys:
        if saved.get(key) != here.get(key) and None not in (saved.get(key), here.get(key)):
            diffs.append(f"{key}: saved {saved.get(key)}, here {here.get(key)}")
    for f in STATE_FIELDS:
        if f in fields_s and f in fields_h and fields_s[f] != fields_h[f]:
            diffs.append(f"recipe.{f}: saved {fields_s[f]}, here {fields_h[f]}")
    if diffs:
        raise ValueError(
            f"The checkpoint {path} was saved with recipe {saved.get('recipe')!r} "
            f"({saved.get('dtype')}); this model was prepared with {here.get('recipe')!r} "
            f"({here.get('dtype')}). They differ in: {'; '.join(diffs)}. Prepare the model "
            "with initialize_fsdp and the recipe and dtype it was saved with. Nothing was "
            "loaded."
        )
    if here["layout"] == "16-bit shards" and saved.get("world_size") != here["world_size"]:
        raise ValueError(
            f"The checkpoint {path} was saved by {saved.get('world_size')} ranks, this run has "
            f"{here['world_size']}: an update-mode (16-bit shards) checkpoint loads on the world "
            "size that saved it (resharding is not supported yet). Resume on "
            f"{saved.get('world_size')} ranks, or export the weights with "
            "fp32_full_state_dict and start a new run from them. Nothing was loaded."
        )


# --------------------------------------------------------------------------- the index
def read_index(path: Path) -> Any:
    """DCP's metadata of ``path``, after checking that every data file is as long as it says:
    a missing index or a short file is a save that did not finish (refused, nothing read)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{path} has no .metadata: the save was cut off before it finished (DCP writes the "
            "index last), or this is not a checkpoint directory written by save_checkpoint. "
            "Nothing was loaded; resume from an earlier checkpoint."
        )
    meta = FileSystemReader(str(path)).read_metadata()
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = path / rel
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            raise ValueError(
                f"The checkpoint {path} is incomplete: {rel} has "
                f"{'no file' if have is None else f'{have} bytes'}, its index expects at "
                f"least {size}. The save was cut off mid-write; nothing was loaded. Resume "
                "from an earlier checkpoint."
            )
    return meta


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts, keyed as DCP keys them (``a.b.c``)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_against_index(template: dict[str, Any], meta: Any, path: Path) -> None:
    """Every tensor the template will read must be in the checkpoint with its shape and dtype;
    the model's parameters must be the checkpoint's (another depth names them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = meta.state_dict_metadata
    tensors = {k: v for k, v in _flat(template).items() if isinstance(v, Tensor)}
    model_here = {k for k in tensors if k.startswith("model.")}
    model_saved = {k for k in saved if k.startswith("model.")}
    missing = sorted(k[6:] for k in model_here - model_saved)
    extra = sorted(k[6:] for k in model_saved - model_here)
    if missing or extra:
        raise ValueError(
            f"The checkpoint {path} holds another model: this model's {missing} are not in "
            f"it, its {extra} are not in this model (another number of layers or another "
            "architecture?). Build the model as it was saved. Nothing was loaded."
        )
    bad = []
    for k, t in tensors.items():
        md = saved.get(k)
        if not isinstance(md, TensorStorageMetadata):
            bad.append(f"{k}: not in the checkpoint")
            continue
        if tuple(md.size) != tuple(t.shape) or md.properties.dtype != t.dtype:
            bad.append(
                f"{k}: checkpoint {tuple(md.size)} {md.properties.dtype}, "
                f"here {tuple(t.shape)} {t.dtype}"
            )
    if bad:
        raise ValueError(
            f"The checkpoint {path} does not match this model and optimizer: "
            + "; ".join(bad[:8])
            + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
            + ". Prepare them as they were saved (recipe, dtype, model). Nothing was loaded."
        )


def blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unblob(data: Any) -> Any:
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"The checkpoint's {META_KEY!r} is not a mixprec description.")
    return torch.load(io.BytesIO(data), weights_only=True)


def read_meta(path: Path, meta: Any) -> dict[str, Any] | None:
    """The ``mixprec_meta`` blob (None in a checkpoint written before it existed)."""
    import torch.distributed.checkpoint as dcp

    if META_KEY not in meta.state_dict_metadata:
        return None
    holder: dict[str, Any] = {META_KEY: b""}
    dcp.load(holder, checkpoint_id=str(path))
    return unblob(holder[META_KEY])


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


def sharded_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The DCP state of a model stepped by an update mode (module docstring)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    lean = optimizer.lean
    inner = optimizer.optimizer
    names = _named(model)
    params = [p for g in inner.param_groups for p in g["params"]]
    # which coded states are coded on every rank (else saved decoded, in fp32, everywhere):
    # every rank lists the same (parameter, key) pairs, in the same order
    coded = [
        (p, k)
        for p in params
        for k, v in sorted(inner.state.get(p, {}).items())
        if isinstance(v, QuantizedState) or (isinstance(v, Tensor) and v.dim() > 0)
    ]
    flags = torch.tensor(
        [int(isinstance(inner.state[p][k], QuantizedState)) for p, k in coded] or [1],
        dtype=torch.int32,
        device=_local(params[0]).device if params else "cpu",
    )
    if dist.is_initialized() and coded:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    everywhere = {(id(p), k) for (p, k), f in zip(coded, flags.tolist()) if f}

    states: dict[str, Any] = {}
    layout: dict[str, dict[str, Any]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for p in params:
        fqn = names[p]
        st = inner.state.get(p)
        if not st:
            continue
        if isinstance(p, DTensor):
            _check_rows(p, fqn)
        out, lay, ext = {}, {}, {}
        for k, v in st.items():
            if isinstance(v, QuantizedState):
                if (id(p), k) in everywhere:
                    by_row = codes_by_row(v)
                    rows = by_row.shape[0]
                    wc, ws = _code_widths(v.shape, v.fmt)
                    out[k] = {
                        "codes": _by_rows(by_row, p, wc),
                        "scale": _by_rows(v.scale.view(rows, ws), p, ws),
                    }
                    lay[k] = {"kind": "codes", "fmt": v.fmt, "code_kind": v.kind}
                    continue
                v = v.dequantize()
            if isinstance(v, DTensor):
                out[k], lay[k] = v, {"kind": "dtensor", "dtype": str(v.dtype)}
            elif isinstance(v, Tensor) and v.dim() == 0:
                out[k], lay[k] = v, {"kind": "scalar", "dtype": str(v.dtype)}
            elif isinstance(v, Tensor) and isinstance(p, DTensor) and v.shape == _local(p).shape:
                out[k] = _like_param(v.contiguous(), p)
                lay[k] = {"kind": "shard", "dtype": str(v.dtype)}
            elif isinstance(v, Tensor):
                raise NotImplementedError(
                    f"save_checkpoint: optimizer state {k!r} of {fqn} has shape "
                    f"{tuple(v.shape)}, neither the shard's {tuple(_local(p).shape)} nor a "
                    "scalar; DCP cannot place it."
                )
            else:
                ext[k] = v
        states[fqn], layout[fqn] = out, lay
        if ext:
            extra[fqn] = ext
    comps = {
        names[p]: _like_param(c, p) for p, c in lean.compensation.items() if isinstance(p, DTensor)
    }
    own = optimizer.mixprec_state_dict()
    lean_own = dict(own.pop("lean"))
    lean_own.pop("compensation")
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in inner.param_groups
    ]
    info = {
        **describe(model, optimizer),
        "layout_of": layout,
        "extra_state": extra,
        "param_groups": groups,
        "own": own,
        "lean": lean_own,
        "compensation": sorted(comps),
    }
    return {
        "model": get_model_state_dict(model),
        "optimizer": {"state": states},
        "compensation": comps,
        META_KEY: blob(info),
    }


# --------------------------------------------------------------------------- update modes: load
def _fresh(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return DTensor.from_local(
            torch.empty_like(v.to_local()),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=v.shape,
            stride=v.stride(),
        )
    return torch.empty_like(v) if isinstance(v, Tensor) else v


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def sharded_template(model: nn.Module, optimizer: Any, info: dict[str, Any]) -> dict[str, Any]:
    """Fresh tensors, shaped like this model's shards, for what ``info`` says was saved."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

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
                    "codes": _by_rows(torch.empty(rows, wc, dtype=torch.uint8), p, wc),
                    "scale": _by_rows(torch.empty(rows, ws, dtype=torch.float32), p, ws),
                }
            elif d["kind"] == "scalar":
                out[k] = torch.empty((), dtype=_dtype(d["dtype"]), device=loc.device)
            else:
                out[k] = _like_param(torch.empty_like(loc, dtype=_dtype(d["dtype"])), p)
        states[fqn] = out
    comps = {
        fqn: _like_param(torch.empty_like(_local(params[fqn])), params[fqn])
        for fqn in info["compensation"]
    }
    for fqn, c in comps.items():  # the compensation's dtype is this optimizer's buffer's
        mine = optimizer.lean.compensation.get(params[fqn]) if optimizer.lean else None
        if mine is not None and mine.dtype != c.dtype:
            comps[fqn] = _like_param(torch.empty_like(mine), params[fqn])
    model_sd = {k: _fresh(v) for k, v in get_model_state_dict(model).items()}
    assert all(isinstance(v, (Tensor, DTensor)) for v in model_sd.values())
    return {"model": model_sd, "optimizer": {"state": states}, "compensation": comps}


@torch.no_grad()
def commit_sharded(
    model: nn.Module, optimizer: Any, info: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """Put a completely read checkpoint into the model and optimizer (bit for bit)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    inner, lean = optimizer.optimizer, optimizer.lean
    set_model_state_dict(model, loaded["model"])
    inner.state.clear()
    for fqn, lay in info["layout_of"].items():
        p = params[fqn]
        local_states = lean is not None and p.dtype in _LOW  # stepped through its shard
        st: dict[str, Any] = {}
        for k, d in lay.items():
            v = loaded["optimizer"]["state"][fqn][k]
            if d["kind"] == "codes":
                shape = _local(p).shape
                rows = _row_shape(shape)[0]
                q = QuantizedState(
                    codes_from_rows(v["codes"].to_local(), shape, d["fmt"]),
                    v["scale"].to_local().reshape(-1).clone(),
                    torch.Size(shape),
                    d["fmt"],
                    d["code_kind"],
                )
                assert q.scale.numel() == rows * _code_widths(shape, d["fmt"])[1]
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
    if lean is not None:
        comps = {params[f]: loaded["compensation"][f] for f in info["compensation"]}
        lean.load_state_dict(
            {
                **info["lean"],
                "compensation": [
                    None if p not in comps else comps[p].to_local() for p in lean.params()
                ],
            }
        )
    own = info["own"]
    for slot, sd in zip(optimizer.slots, own["scalers"]):
        slot.scaler.load_state_dict(sd)
        slot.pending.clear()
    optimizer.skipped_steps = int(own["skipped_steps"])
    optimizer.step_skipped = bool(own.get("step_skipped", False))


def check_groups(optimizer: Any, info: dict[str, Any], model: nn.Module, path: Path) -> None:
    """The saved parameter groups must list this optimizer's parameters, group by group."""
    names = _named(model)
    here = [[names[p] for p in g["params"]] for g in optimizer.optimizer.param_groups]
    saved = [g["params"] for g in info["param_groups"]]
    if here != saved:
        raise ValueError(
            f"The checkpoint {path} has parameter groups {saved}, this optimizer {here}: build "
            "the optimizer as it was saved (same groups, same order). Nothing was loaded."
        )
    own = info["own"]
    if len(own["scalers"]) != len(optimizer.slots):
        raise ValueError(
            f"The checkpoint has {len(own['scalers'])} loss scalers, this optimizer has "
            f"{len(optimizer.slots)} (num_losses). Nothing was loaded."
        )


def data_files(path: str | os.PathLike) -> list[Path]:
    return sorted(Path(path).glob("*.distcp"))
