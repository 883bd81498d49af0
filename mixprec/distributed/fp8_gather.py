"""FSDP2 all-gathers the weights of tensorwise FP8 layers in FP8.

Design: FSDP2 lets the tensor it shards define how it is gathered: if the local shard has
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``, FSDP gathers what the first returns and
makes the unsharded parameter from what the second builds. :func:`gather_in_fp8` gives those two
hooks to the fp32 shards (the master weights) of the FP8 layers chosen when the model is
sharded. Before each all-gather of such a weight, every rank

1. casts its shard to FSDP's ``param_dtype`` (bf16 / fp16), as the 16-bit gather would;
2. takes the amax of that 16-bit shard and all-reduces it (MAX) over the shard's mesh: the
   amax of the whole 16-bit weight, one 4-byte all-reduce per weight and gather;
3. casts the shard to e4m3 with ``448 / amax``, the scale the FP8 layer computes from the
   whole 16-bit weight (:func:`mixprec.fp8.quantization.scale_for`).

FSDP then all-gathers e4m3 bytes (1 byte a weight element instead of 2) and the hook after
the gather wraps them with the scale as a :class:`~mixprec.fp8.gathered.GatheredFP8Weight`,
which the FP8 linear uses as its weight operand in forward and backward. Casting an element
depends only on it and the scale, so the gathered bytes are the bytes the 16-bit gather's FP8
layer computes: the losses and gradients do not change, bit for bit. Autograd's gradient of
that weight is 16-bit, so FSDP reduce-scatters it as before.

The shards themselves are left as they are (plain fp32 tensors in FSDP's DTensors): the hooks
are attributes of the local shard tensor, so the optimizer, checkpoints and state dicts see
nothing new. A shard whose amax is NaN gathers under an infinite amax (scale 0): the GEMM's
dequantization factor is then infinite and every output non-finite, as with the 16-bit
gather's NaN scale, so an overflow is never hidden.

What is gathered in FP8: the weights of the Linears that run in FP8. A layer chosen when the
model is sharded (``layers="all"``, a predicate, an :class:`~mixprec.fp8.FP8Plan`) gathers in
FP8 from the first step; a layer that ``layers="auto"`` judges at its first batch decides after
that batch's all-gather, so its first step gathers 16 bits and the next ones FP8 (FSDP's
gather buffers, whose dtype FSDP fixes at the first gather, are dropped and made again). A
weight shared by several modules, and a shard offloaded to the CPU, gather in 16 bits.
Rowwise recipes gather in 16 bits (:mod:`mixprec.fp8.config`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from mixprec._core._warnings import user_stacklevel
from mixprec._core.hardware import MixprecPerformanceWarning
from mixprec.fp8.config import FP8Config
from mixprec.fp8.gathered import GatheredFP8Weight
from mixprec.fp8.layers import FP8_ATTR
from mixprec.fp8.quantization import E4M3, amax, quantize, scale_for

__all__ = ["gather_in_fp8", "gathered_in_fp8"]

_HOOKED = "_mixprec_fp8_gather"  # on a local shard with the hooks: its _ShardCast


class _ShardCast:
    """The two FSDP2 all-gather hooks of one weight shard (FSDP's signatures, torch 2.13)."""

    def __init__(self, shard: Tensor) -> None:
        self.shard = shard

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        shard = self.shard
        low = mp_policy.param_dtype
        if low is not None and low != shard.dtype:
            shard = shard.to(low)
        local = amax(shard) if shard.numel() else shard.new_zeros((), dtype=torch.float32)
        # MAX over the ranks need not carry a NaN: an infinite amax (scale 0) poisons instead
        local = torch.nan_to_num(local, nan=math.inf).reshape(1)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = scale_for(local.reshape(()), E4M3)
        data = quantize(shard, E4M3, None, scale=scale).data
        rows = -(-outer_size[0] // mesh.size())  # FSDP pads every shard to the first's rows
        if data.shape[0] != rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: tuple[Tensor, ...],
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:  # FSDP refilled the buffer ``out`` views: only the scale is new
            out.scale = scale
            return None
        return GatheredFP8Weight(data, scale, param_dtype), (data,)


#: what the hooks rely on in FSDP2's per-parameter record (torch 2.13's ``FSDPParam``)
_RECORD = ("_module_info", "_sharded_local_tensor", "_init_extensions", "all_gather_outputs")


def _fsdp_params(model: nn.Module) -> list[Any] | None:
    """FSDP2's per-parameter records of every unit in ``model``; None where this torch does
    not lay them out as torch 2.13 does."""
    out = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group", 0)
        if group == 0:
            return None
        if group is not None:
            out.extend(group.fsdp_params)
    if not all(hasattr(p, name) for p in out for name in _RECORD):
        return None
    return out


def _candidates(model: nn.Module) -> list[tuple[Any, Any]]:
    """(FSDP record, FP8 layer) of each weight that may gather in FP8: a tensorwise FP8 layer's
    (or a pending one's) unshared 2-D weight, not offloaded to the CPU."""
    out = []
    for fsdp_param in _fsdp_params(model) or ():
        info = fsdp_param._module_info
        layer = info.module.__dict__.get(FP8_ATTR)
        if info.param_name != "weight" or layer is None or layer.recipe.rowwise:
            continue
        if info.shared_modules or fsdp_param.offload_to_cpu:
            continue
        if fsdp_param._sharded_local_tensor.dim() == 2:
            out.append((fsdp_param, layer))
    return out


def _install(fsdp_param: Any) -> None:
    """Give a sharded weight the FP8 all-gather hooks, and drop FSDP's buffers of an earlier
    16-bit gather (their dtype is fixed at the first gather): the next gather makes new ones."""
    shard = fsdp_param._sharded_local_tensor
    hooks = _ShardCast(shard)
    shard.fsdp_pre_all_gather = hooks.fsdp_pre_all_gather
    shard.fsdp_post_all_gather = hooks.fsdp_post_all_gather
    setattr(shard, _HOOKED, hooks)
    fsdp_param.all_gather_outputs = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param
    fsdp_param._init_extensions()  # FSDP looks for the hooks when it records a parameter


def gather_in_fp8(model: nn.Module, config: FP8Config | None) -> None:
    """Give the FP8 layers of a sharded, FP8-prepared ``model`` the FP8 all-gather where
    ``config`` asks for it (see the module docstring).

    Layers chosen already get it now; layers that ``layers="auto"`` decides at their first
    batch get it at the first forward after they decided for FP8, when FSDP has resharded
    them (every rank decides alike, so every rank switches at the same step)."""
    if config is None or not config.gathers_fp8:
        return
    if _fsdp_params(model) is None:
        warnings.warn(
            f"FP8Config(all_gather={config.all_gather!r}): FSDP2's parameter records in torch "
            f"{torch.__version__} are not laid out as in torch 2.13, where the FP8 all-gather "
            "was built: FP8 layers' weights are all-gathered in 16 bits and cast after the "
            "gather (the same numbers, twice the bytes).",
            MixprecPerformanceWarning,
            stacklevel=user_stacklevel(),
        )
        return
    pending = []
    for fsdp_param, layer in _candidates(model):
        if layer.choice is None:
            pending.append((fsdp_param, layer))
        elif layer.fp8:
            _install(fsdp_param)
    if not pending:
        return

    def switch(module: nn.Module, args: Any) -> None:
        for item in list(pending):
            fsdp_param, layer = item
            if layer.choice is None or fsdp_param.sharded_state.name != "SHARDED":
                continue
            pending.remove(item)
            if layer.fp8:
                _install(fsdp_param)
        if not pending:
            handle.remove()

    handle = model.register_forward_pre_hook(switch, prepend=True)


def gathered_in_fp8(model: nn.Module) -> list[str]:
    """The names of ``model``'s weights that FSDP2 all-gathers in FP8."""
    names = {id(m): name for name, m in model.named_modules()}
    return [
        f"{names[id(p._module_info.module)]}.{p._module_info.param_name}".lstrip(".")
        for p in _fsdp_params(model) or ()
        if hasattr(p._sharded_local_tensor, _HOOKED)
    ]
