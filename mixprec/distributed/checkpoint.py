"""Checkpoints under DDP and FSDP2, with the mixprec optimizer state (masters, loss scalers).

Design (``docs/design.md``, "Distributed training"; DeepSpeed's FP16
optimizer forgets ``cur_hysteresis`` on save, a resumed run then diverges from an uninterrupted
one):

* Every field of the mixprec optimizer is saved -- inner optimizer state, fp32 masters, every
  loss scaler's config and counters, the skip counters -- so a resumed run repeats an
  uninterrupted one bit for bit (given the same data order).
* **Replicated models (DDP, or no process group):** rank 0 writes one ``torch.save`` file with
  the unwrapped module's state dict (no ``module.`` prefix) and ``optimizer.state_dict()``;
  the other ranks wait at a barrier. Every rank loads the same file, so the ranks stay equal.
  The file loads with ``torch.load(weights_only=True)``.
* **Sharded models (FSDP2, DTensor parameters):** a ``torch.distributed.checkpoint`` directory
  in which each rank writes its own shards.

  - With fp32 master shards (O1-O3 without an update mode), model and inner-optimizer state go
    through ``torch.distributed.checkpoint.state_dict`` (keyed by parameter names, so the
    checkpoint can be resharded to another world size), and the loss-scaler state rides along
    as plain values.
  - With an update mode (``"lean"``, ``Recipe("O3", update="kahan")``: 16-bit shards, no
    masters) every per-shard state -- 16-bit and fp32 moments, Kahan compensation, 8- and
    4-bit codes with their block scales -- is saved as a DTensor sharded by rows like its
    parameter, in the dtype it is held in; scalars, hyper-parameters, loss scalers, skip
    counters and the rounding step count are saved once (:mod:`mixprec.distributed._dcp_layout`
    has the layout). It loads on another world size too (resharded by rows; what stays bit
    for bit is in ``docs/distributed.md``).
  - Both record the recipe and dtype. ``load_checkpoint`` checks the directory against DCP's
    index (a file shorter than the index says: a save cut off mid-write), the recipe, the dtype
    and the parameters (names, shapes, dtypes) before it reads anything into the model, and
    refuses with what differs. A checkpoint of another recipe (fp32 master shards into an
    update mode's 16-bit shards, one update mode or state storage into another, and back) is
    carried over by the one-process rules, shard by shard, and reported
    (:mod:`mixprec.distributed._dcp_cross`); another dtype, FP8 setting or number of losses is
    refused.
* :func:`fp32_full_state_dict` gathers a plain fp32 state dict (FSDP: all-gathered, on CPU) that
  loads into the unwrapped fp32 model, the distributed form of :func:`mixprec.fp32_state_dict`.
* **Offline, without ranks or mixprec's model:** :func:`fp32_state_dict_from_checkpoint` reads
  what torch's own ``dcp_to_torch_save`` made of an FSDP2 directory (one file, every shard
  joined, ``mixprec_meta`` kept) and computes the same dict as :func:`fp32_full_state_dict` at
  that step, bit for bit: the values are elementwise in the weight and its compensation, so
  joined shards give what gathered shards give. torch's converter reads every layout mixprec
  writes (16-bit and fp32 shards, codes and scales, the blob), so mixprec needs none of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from mixprec._core.fp32_values import fp32_state_dict
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._core.recipe_change import announce
from mixprec._core.resume import MIXPREC_KEY, kahan_fp32, pack_state_dict
from mixprec.distributed import _dcp_checks as checks
from mixprec.distributed import _dcp_cross as cross
from mixprec.distributed import _dcp_layout as layout

__all__ = [
    "fp32_full_state_dict",
    "fp32_state_dict_from_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_FORMAT = "mixprec-full/1"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError(
            "Expected the optimizer returned by mixprec.initialize / "
            f"initialize_fsdp, received {type(optimizer).__name__}."
        )


def _mixprec_part(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    """The optimizer's own state without the inner optimizer (saved by DCP by name)."""
    part = optimizer.mixprec_state_dict()
    if part.get("masters"):
        raise NotImplementedError(
            "Separate fp32 masters on a sharded model are not supported: "
            "build the FSDP model with mixprec.distributed.initialize_fsdp, "
            "whose masters are FSDP's own fp32 shards."
        )
    return part


def _dcp_state(model: nn.Module, optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer.optimizer),
        MIXPREC_KEY: _mixprec_part(optimizer),
    }


def _save_sharded(path: Path, model: nn.Module, optimizer: MixedPrecisionOptimizer) -> None:
    """DCP rewrites the data files of an existing directory in place and its index last (by a
    rename): the old index is removed first, so that a save into it that does not finish
    leaves a directory ``load_checkpoint`` refuses, not old and new shards under one index."""
    import torch.distributed.checkpoint as dcp

    if _dist():
        if dist.get_rank() == 0:
            (path / ".metadata").unlink(missing_ok=True)
        dist.barrier()
    if optimizer.updater is not None:  # 16-bit shards stepped by an update mode
        state = layout.sharded_state(model, optimizer)
    else:
        state = _dcp_state(model, optimizer)
        state[checks.META_KEY] = checks.blob(checks.describe(model, optimizer))
    dcp.save(state, checkpoint_id=str(path))


def _load_sharded(path: Path, model: nn.Module, optimizer: MixedPrecisionOptimizer) -> None:
    """Check the directory, the recipe and the parameters, then read; a refused load changes
    nothing."""
    import torch.distributed.checkpoint as dcp

    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a torch.distributed.checkpoint directory; a "
            "sharded (FSDP) model loads what save_checkpoint wrote for "
            "a sharded model."
        )
    index = checks.read_index(path)
    info = checks.read_meta(path, index)  # None: written before the description existed
    here = checks.describe(model, optimizer)
    if info is not None and checks.check_description(info, here, path):
        cross.load(path, index, info, model, optimizer)  # another recipe's: carried over
        return
    if optimizer.updater is not None:
        if info is None or "layout_of" not in info:
            raise ValueError(
                f"{path} was not saved from a model stepped by an update mode (16-bit "
                f"shards); this one uses update={optimizer.updater.update!r}. Prepare the model "
                "with the recipe it was saved with. Nothing was loaded."
            )
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # another depth: named by the parameters, before the groups that list them
        checks.check_against_index({"model": get_model_state_dict(model)}, index, path)
        checks.check_groups(optimizer, info, model, path)
        template = layout.sharded_template(model, optimizer, info)
        checks.check_against_index(template, index, path)
        dcp.load(template, checkpoint_id=str(path))  # fresh tensors: the model is untouched
        layout.commit_sharded(model, optimizer, info, template)
        announce(optimizer, [])  # the same recipe: nothing to report
        return
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _dcp_state(model, optimizer)  # the template DCP loads into, in place
    checks.check_against_index({"model": state["model"]}, index, path)
    if info is not None:
        state[checks.META_KEY] = b""
    dcp.load(state, checkpoint_id=str(path))
    state.pop(checks.META_KEY, None)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer.optimizer, state["optimizer"])
    optimizer.load_state_dict(pack_state_dict(optimizer.optimizer.state_dict(), state[MIXPREC_KEY]))


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: MixedPrecisionOptimizer
) -> None:
    """Save model and mixprec optimizer; call on **every** rank.

    ``path`` is a file for replicated models (DDP / single process, written by rank 0) and a
    directory for sharded (FSDP2) models (every rank writes its shards).
    """
    _check_optimizer(optimizer)
    path = Path(path)
    if _sharded(model):
        _save_sharded(path, model, optimizer)
        return
    if not _dist() or dist.get_rank() == 0:
        state = {
            "format": _FORMAT,
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        _atomic_save(state, path)
    if _dist():
        dist.barrier()


def _atomic_save(state: Any, path: Path) -> None:
    """Write ``state`` to ``path`` so that a crash or power loss leaves the old file or the new
    one, never a truncated or empty one: write a temporary file, flush and fsync it, rename it
    over ``path``, fsync the directory. A ``.tmp`` left by a killed save is replaced; a save
    that fails with an exception (disk full, unpicklable state) removes its own."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:  # "wb" truncates a stale temporary file
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: MixedPrecisionOptimizer
) -> None:
    """Restore what :func:`save_checkpoint` wrote into a freshly built model and optimizer.

    Build and prepare them exactly as for the saved run (same level, ``wrap_ddp`` /
    ``initialize_fsdp`` with the same units), then load; call on every rank.
    """
    _check_optimizer(optimizer)
    path = Path(path)
    if _sharded(model):
        _load_sharded(path, model, optimizer)
        return
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a directory (a sharded FSDP checkpoint); this model "
            "is not sharded. Load it with the same FSDP setup it was saved "
            "with."
        )
    first = next(model.parameters(), None)
    device = first.device if first is not None else "cpu"
    state = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(
            f"{path} was not written by mixprec.distributed.save_checkpoint (format {_FORMAT!r})."
        )
    _unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _kahan_full_values(model: nn.Module, optimizer: Any) -> dict[str, Tensor]:
    """The exact fp32 values ``w + c`` of 16-bit shards under a Kahan update, all-gathered by
    name (a collective): without them the export would be the rounded weights."""
    from torch.distributed.tensor import DTensor

    comps = getattr(getattr(optimizer, "updater", None), "compensation", {})
    out = {}
    for name, p in model.named_parameters():
        comp = comps.get(p)
        if comp is None or not isinstance(p, DTensor):
            continue
        value = kahan_fp32(p.to_local(), comp)
        out[name] = DTensor.from_local(
            value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        ).full_tensor()
    return out


def fp32_full_state_dict(
    model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
) -> dict[str, Tensor]:
    """A full fp32 state dict that loads into the plain, unwrapped fp32 model.

    DDP / single process: :func:`mixprec.fp32_state_dict` of the unwrapped module (masters where
    they exist). FSDP2: the fp32 shards all-gathered and moved to CPU; a collective, so call it
    on every rank (each gets the full dict).
    """
    if _sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # cpu_offload=True would keep the result on rank 0 only; every rank gets it here.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        full.update(_kahan_full_values(model, optimizer))
        return _fp32_cpu(full)
    return fp32_state_dict(_unwrap(model), optimizer)


def _fp32_cpu(full: dict[str, Tensor]) -> dict[str, Tensor]:
    """Floating tensors as fp32 (float64 kept), every tensor detached and on the CPU."""
    return {
        k: (v.float() if v.is_floating_point() and v.dtype != torch.float64 else v).detach().cpu()
        for k, v in full.items()
    }


_CONVERT = "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(checkpoint_dir, 'model.pt')"


def _read_converted(checkpoint: Any) -> dict[str, Any]:
    """The dict of a converted checkpoint, from the dict itself or the file holding it."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        if path.is_dir():
            raise ValueError(
                f"{path} is a directory (a torch.distributed.checkpoint, as save_checkpoint "
                f"writes for FSDP2); this function reads the one file made of it. Run {_CONVERT} "
                "once, then pass 'model.pt'."
            )
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; pass the file {_CONVERT} wrote.")
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle, zip and weights_only errors alike
            raise ValueError(
                f"{path} is not a torch.save file readable with weights_only=True "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass the "
                f"file {_CONVERT} wrote from a save_checkpoint directory."
            ) from e
    if not isinstance(checkpoint, dict):
        raise TypeError(
            f"Expected a path or the dict torch.load returns for a converted checkpoint, "
            f"received {type(checkpoint).__name__}."
        )
    return checkpoint


def fp32_state_dict_from_checkpoint(checkpoint: str | os.PathLike | dict) -> dict[str, Tensor]:
    """The plain fp32 state dict of an FSDP2 ``save_checkpoint`` directory, offline.

    ``checkpoint`` is the file ``dcp_to_torch_save(checkpoint_dir, file)`` wrote (or the dict
    ``torch.load`` returns for it); no process group and no model are needed. The result is
    :func:`fp32_full_state_dict` of the run at the step it was saved, bit for bit: fp32 masters
    under O1-O3, the widened 16-bit weights under an update mode, each weight's ``w + c`` under a
    Kahan update; buffers too, keyed by the unwrapped module's names, on the CPU. DCP writes a
    buffer once, from one rank: one that differs between ranks (BatchNorm's running statistics
    without ``SyncBatchNorm``) is that rank's copy here.
    """
    sd = _read_converted(checkpoint)
    if sd.get("format") == _FORMAT:
        raise ValueError(
            f"Received a replicated model's save_checkpoint file (format {_FORMAT!r}, DDP or one "
            "process): it has no shards to join. Load it with load_checkpoint into the model "
            "prepared as it was saved and call fp32_full_state_dict (or mixprec.fp32_state_dict)."
        )
    # an O1-O3 checkpoint written before checkpoints recorded their recipe: fp32 masters only
    legacy = checks.META_KEY not in sd and {"optimizer", MIXPREC_KEY} <= sd.keys()
    meta = sd.get(checks.META_KEY)
    if not isinstance(sd.get("model"), dict) or not (legacy or isinstance(meta, bytes)):
        raise ValueError(
            f"Received a dict with keys {sorted(map(str, sd))[:8]}, not a converted mixprec "
            f"FSDP2 checkpoint (which has 'model' and {checks.META_KEY!r}, a blob). Pass the "
            f"file {_CONVERT} wrote from a directory save_checkpoint wrote."
        )
    info = {"format": checks.FORMAT} if legacy else checks.unblob(meta)
    if not isinstance(info, dict) or info.get("format") != checks.FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(
            f"The checkpoint's {checks.META_KEY!r} describes format {found!r}; this version "
            f"reads {checks.FORMAT!r}. Convert it with the mixprec version that wrote it."
        )
    model, comps = sd["model"], sd.get("compensation") or {}
    names = info.get("compensation") or []  # the weights stepped by a Kahan update
    missing = [f"compensation.{n}" for n in names if n not in comps]
    missing += [f"model.{n}" for n in names if n not in model]
    if missing:
        raise ValueError(
            f"The checkpoint lacks {missing[:8]} that its {checks.META_KEY!r} lists (a dict "
            f"edited or converted in part?). Convert the directory again with {_CONVERT}."
        )
    full = dict(model)
    for name in names:
        full[name] = kahan_fp32(model[name], comps[name])
    bad = sorted(k for k, v in full.items() if not isinstance(v, Tensor))
    if bad:
        raise ValueError(
            f"The checkpoint's 'model' entries {bad[:8]} are not tensors; a converted checkpoint "
            f"holds tensors there. Convert the directory again with {_CONVERT}."
        )
    return _fp32_cpu(full)
