"""A weight that arrives in FP8: the FSDP2 all-gather's result for a tensorwise FP8 layer.

Design: under FSDP2 a tensorwise FP8 layer's weight can be all-gathered already cast to e4m3
(see :mod:`mixprec.fp8.config`, ``all_gather``). What FSDP then hands the layer as its
unsharded parameter is a :class:`GatheredFP8Weight`: the gathered FP8 bytes and the one scale
that every rank cast its shard with. It reports the 16-bit dtype the weight would otherwise
have been gathered in, so autograd gives it a 16-bit gradient (the gradient FSDP
reduce-scatters, as before) and the FP8 linear (:mod:`.linear`) takes its data and scale as
the weight operand of its GEMMs instead of casting the weight again.

Any other operation on it (reading ``module.weight`` in a hook, ``F.linear`` on it) runs on its
values in that 16-bit dtype, dequantized from the FP8 bytes: the values the GEMMs use. Writing
into it is refused: it is a view of FSDP's all-gather buffer, rewritten at every gather. Only
the views FSDP itself takes of its parameter (``detach``, ``alias``, ``as_strided``, ``view``,
``slice``) stay FP8.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

from mixprec.fp8.quantization import E4M3, Float8Data

__all__ = ["GatheredFP8Weight"]

_aten = torch.ops.aten
#: the views FSDP2 takes of the tensor its post-all-gather hook returns (and nn.Parameter's
#: detach): they stay FP8, sharing the gathered bytes and the scale
_VIEWS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.view.default,
    _aten.slice.Tensor,
}


class GatheredFP8Weight(Tensor):
    """An all-gathered weight held as e4m3 bytes (``data``) and one float32 ``scale`` (the
    multiplier the bytes were cast with), standing for a ``dtype`` tensor of their shape."""

    data8: Tensor
    scale: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype) -> GatheredFP8Weight:
        if data.dtype != E4M3:
            raise TypeError(f"GatheredFP8Weight holds float8_e4m3fn bytes, not {data.dtype}.")
        return Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        self.data8 = data
        self.scale = scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def float8(self) -> Float8Data:
        """The FP8 bytes and their scale, as :mod:`.linear` takes a weight operand."""
        return Float8Data(self.data8, self.scale)

    def dequantize(self) -> Tensor:
        """The values the bytes stand for, in this tensor's dtype (a plain tensor)."""
        return (self.data8.float() / self.scale).to(self.dtype)

    def __repr__(self) -> str:
        return (
            f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"scale={float(self.scale):.6g})"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS:
            src = args[0]
            return cls(func(src.data8, *args[1:], **kwargs), src.scale, src.dtype)
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func}: a GatheredFP8Weight is FSDP's all-gathered FP8 weight, rewritten at "
                "every all-gather; it cannot be written to."
            )
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)
