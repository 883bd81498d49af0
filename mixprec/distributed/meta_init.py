"""A model built on the meta device, materialized shard by shard after ``fully_shard``.

Design: building the whole fp32 model on every rank before sharding costs each rank the
model's full 4 bytes per parameter at its peak, however many ranks share it afterwards.
:func:`mixprec.distributed.initialize_fsdp` accepts a model built under
``torch.device("meta")`` instead: it shards the meta model, allocates each rank's shards
(``to_empty``), and then fills them module by module -- each module's parameters are made
whole for a moment in fp32 on the rank's device, its ``reset_parameters()`` runs on them, and
the rank keeps its own rows (cast to the shard's dtype). The peak is one module's parameters,
not the model's.

Every rank draws the same numbers (a CPU mesh has no sharded random generator), and the
modules are reset in ``model.modules()`` order, the order a model's constructor normally
initializes them in: a model whose initialization is its modules' ``reset_parameters`` gets
the weights that building it on the device under the same seed gives, bit for bit. A module
that holds parameters or buffers and has no ``reset_parameters`` (a raw ``nn.Parameter``, a
buffer computed in ``__init__``) cannot be filled this way: it is refused, with the fix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixprec._core.update.rounding import shard_offset

__all__ = ["check", "device_for", "is_meta", "materialize"]


def is_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (any parameter or buffer there)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def device_for(mesh_device_type: str | None) -> torch.device:
    """The device a meta model's shards go to: the mesh's type, else the process group's."""
    kind = mesh_device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def check(model: nn.Module) -> None:
    """Refuse a meta model that :func:`materialize` cannot fill."""
    for name, m in model.named_modules():
        own = [*m._parameters.values(), *m._buffers.values()]
        if any(t is not None for t in own) and not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(
                f"initialize_fsdp received a model on the meta device whose module "
                f"{name or type(model).__name__!r} ({type(m).__name__}) holds parameters or "
                "buffers but has no reset_parameters(): its shards could not be initialized. "
                "Give it a reset_parameters() that initializes them in place, or build the "
                "model on a real device."
            )


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, keep: bool = False) -> dict[str, Tensor]:
    """Allocate the sharded ``model``'s shards on ``device`` and fill them (module docstring);
    ``keep``: return each 16-bit shard's fp32 rows by parameter name (a Kahan compensation
    starts from them, as it does from the whole fp32 model without the meta device)."""
    kept: dict[str, Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for m in model.modules():
        params = {n: p for n, p in m._parameters.items() if p is not None}
        if not params and not m._buffers:
            continue
        # a DTensor's shape is the whole parameter's
        whole = {
            n: torch.empty(p.shape, dtype=torch.float32, device=device) for n, p in params.items()
        }
        for n, t in whole.items():  # the module initializes plain, whole fp32 tensors
            m._parameters[n] = nn.Parameter(t, requires_grad=False)
        try:
            m.reset_parameters()
        finally:
            for n, p in params.items():
                rows = _keep_rows(p, whole[n])
                if keep and p.dtype != torch.float32:
                    kept[names[id(p)]] = rows.clone()
                m._parameters[n] = p
    return kept


def _keep_rows(p: Tensor, whole: Tensor) -> Tensor:
    """Copy this rank's rows of ``whole`` into ``p``'s local shard, in its dtype; return them."""
    local = p.to_local() if hasattr(p, "to_local") else p
    start = shard_offset(p)
    rows = whole.reshape(-1)[start : start + local.numel()].view(local.shape)
    local.copy_(rows.to(local.dtype))
    return rows
