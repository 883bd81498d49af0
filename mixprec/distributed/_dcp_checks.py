"""Checks of an FSDP2 checkpoint before anything is read into the model (``load_checkpoint``).

Design (``docs/distributed.md``, "Checkpoints"): every FSDP2 checkpoint carries a description
of the recipe, dtype, layout and world size that saved it (``mixprec_meta``, one blob DCP writes
once). A load reads DCP's index first -- a missing ``.metadata`` or a data file shorter than the
index says is a save that did not finish -- then compares the description and the model's
parameters (names, shapes, dtypes) with the checkpoint's, and refuses with what differs; the
refusal is raised before the model or optimizer is written, on every rank alike (the checks
read the same files and descriptions everywhere). Another recipe's checkpoint (another layout,
update mode or state storage) is not refused but carried over (:mod:`._dcp_cross`); another
16-bit dtype, FP8 setting or number of losses is.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

META_KEY = "mixprec_meta"
FORMAT = "mixprec-dcp/1"
RECIPE_ATTR = "_mixprec_fsdp_recipe"  # (recipe, 16-bit dtype), set by initialize_fsdp
#: recipe fields that decide what a checkpoint holds: compared on load
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


# --------------------------------------------------------------------------- description
def describe(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What the checkpoint of ``model`` holds, compared on load."""
    recipe, low = model.__dict__.get(RECIPE_ATTR, (None, None))
    updater = getattr(optimizer, "updater", None)
    return {
        "format": FORMAT,
        "layout": "16-bit shards" if updater is not None else "fp32 master shards",
        "recipe": None if recipe is None else str(recipe),
        "fields": {} if recipe is None else {f: _word(getattr(recipe, f)) for f in STATE_FIELDS},
        "dtype": None if low is None else str(low),
        "update": None if updater is None else updater.update,
        "state_dtype": None if updater is None else _states_word(updater.plan.optimizer_states),
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


def _states_word(states: Any) -> str:
    """The plan's ``optimizer_states`` as checkpoints spell it (a map where it has items)."""
    return _word(dict(states) if isinstance(states, tuple) else states)


#: recipe fields a checkpoint is not carried across (with the 16-bit dtype; the rounding seed
#: where the saved update mode is this one): every other difference is another recipe's layout
#: that :mod:`mixprec.distributed._dcp_cross` carries over
FIXED_FIELDS = ("fp8", "num_losses")


def check_description(saved: dict[str, Any], here: dict[str, Any], path: Path) -> bool:
    """Refuse another format, dtype, FP8 setting, number of losses, or rounding seed under the
    same update mode; return whether the checkpoint is another recipe's (its layout, update
    mode, state storage or other recipe fields differ: carried over). Another world size
    loads."""
    if saved.get("format") != FORMAT:
        raise ValueError(
            f"{path} holds a {saved.get('format')!r} checkpoint; this version reads {FORMAT!r}."
        )
    carried, fixed = [], []
    fields_s, fields_h = saved.get("fields") or {}, here.get("fields") or {}
    # with both recipes known their fields name what differs; else what the optimizer shows
    keys = ["layout", "dtype"] + ([] if fields_s and fields_h else ["update", "state_dtype"])
    for key in keys:
        if saved.get(key) != here.get(key) and None not in (saved.get(key), here.get(key)):
            diff = f"{key}: saved {saved.get(key)}, here {here.get(key)}"
            (fixed if key == "dtype" else carried).append(diff)
    same_update = saved.get("update") == here.get("update")
    for f in STATE_FIELDS:
        if f in fields_s and f in fields_h and fields_s[f] != fields_h[f]:
            diff = f"recipe.{f}: saved {fields_s[f]}, here {fields_h[f]}"
            fix = f in FIXED_FIELDS or (f == "update_seed" and same_update)
            (fixed if fix else carried).append(diff)
    if fixed:
        raise ValueError(
            f"The checkpoint {path} was saved with recipe {saved.get('recipe')!r} "
            f"({saved.get('dtype')}); this model was prepared with {here.get('recipe')!r} "
            f"({here.get('dtype')}). They differ in: {'; '.join(fixed)}. A checkpoint is "
            "carried into another recipe's masters, update mode and state storage, but not "
            "into another 16-bit dtype, FP8 setting, number of losses, or rounding seed of the "
            "same update mode. Prepare the model with initialize_fsdp and those saved values "
            "(the rest of the recipe may differ). Nothing was loaded."
        )
    # another world size is allowed: every per-shard state is keyed by name and sharded by
    # rows, so DCP hands each rank its new rows (docs/distributed.md, "Resharding")
    return bool(carried)


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


def check_groups(optimizer: Any, info: dict[str, Any], model: nn.Module, path: Path) -> None:
    """The saved parameter groups must list this optimizer's parameters, group by group."""
    names = {p: n for n, p in model.named_parameters()}
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
