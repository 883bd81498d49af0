"""Activation memory: the tensors autograd saves for backward, stored in fewer bytes.

``activations=`` (an :class:`ActivationConfig` or a shortcut) installs a saved-tensor hooks pair
around the model's forward, at its boundary: activations of at least ``min_numel`` elements are
stored in FP8 (a power-of-2 scale per row) or the 16-bit compute dtype, weights are left alone,
and the outputs of GELU-like ops are recomputed in backward instead of stored. Design:
``docs/design.md``, "Memory, accounted".
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from mixprec.fp8.quantization import E4M3, Float8Data, dequantize_2d, quantize_2d

__all__ = ["STORAGES", "ActivationConfig", "SavedTensorStorage", "as_activation_config"]

STORAGES = ("fp8", "16-bit", None)
_SHORTCUTS = ("fp8", "16-bit", "recompute")
_ROW = 64  # fewest elements that share an FP8 scale: scales cost 4 bytes each
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# autograd nodes that only view or cast their single input: a weight seen through them is
# still a weight (w.t() in a linear, the bf16 copy autocast makes of an fp32 weight)
_PASS_THROUGH = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "CloneBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "TBackward0",
        "ToCopyBackward0",
        "TransposeBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)
# elementwise ops that save their input: their output can be recomputed from it, bitwise
_RECOMPUTE: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "GeluBackward0": lambda node, x: F.gelu(x, approximate=node._saved_approximate),
    "SiluBackward0": lambda node, x: F.silu(x),
    "MishBackward0": lambda node, x: F.mish(x),
    "HardswishBackward0": lambda node, x: F.hardswish(x),
}


@dataclass(frozen=True)
class ActivationConfig:
    """How a model's forward stores the tensors autograd saves for backward.

    Args:
        storage: ``"fp8"`` (float8 e4m3, a power-of-2 scale per row), ``"16-bit"`` (float32
            saved tensors in the compute dtype) or None (as saved).
        recompute: recompute the outputs of GELU, SiLU, Mish and Hardswish in backward instead
            of storing them (exact: no change to gradients).
        min_numel: saved tensors with fewer elements are kept as they are (the hooks' Python
            cost is per tensor; small ones hold little memory).

    The shortcuts ``activations="fp8"``, ``"16-bit"`` and ``"recompute"`` are
    ``ActivationConfig("fp8")``, ``ActivationConfig("16-bit")`` and
    ``ActivationConfig(storage=None)``.
    """

    storage: str | None = "fp8"
    recompute: bool = True
    min_numel: int = 2**16

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ValueError(
                f"ActivationConfig(storage={self.storage!r}) is not one of {STORAGES}: "
                "'fp8' stores saved activations as float8 with per-row scales, '16-bit' stores "
                "float32 ones in the compute dtype, None keeps them as saved."
            )
        if not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ValueError(
                f"ActivationConfig(min_numel={self.min_numel!r}) must be a positive int."
            )
        if self.storage is None and not self.recompute:
            raise ValueError(
                "ActivationConfig(storage=None, recompute=False) changes nothing; pass "
                "activations=None instead."
            )


def as_activation_config(spec: Any) -> ActivationConfig | None:
    """``None``, a shortcut (``"fp8"``, ``"16-bit"``, ``"recompute"``) or an
    :class:`ActivationConfig`."""
    if spec is None or isinstance(spec, ActivationConfig):
        return spec
    if isinstance(spec, str) and spec in _SHORTCUTS:
        return ActivationConfig(storage=None if spec == "recompute" else spec)
    raise TypeError(
        f"activations= takes None, one of {_SHORTCUTS} or a mixprec.ActivationConfig; received "
        f"{type(spec).__name__} {spec!r}."
    )


def _is_weight(t: Tensor) -> bool:
    """A parameter, or a view or cast of one (through autograd's history)."""
    fn = t.grad_fn
    if fn is None:
        return t.requires_grad  # a leaf that requires grad: a parameter
    while fn is not None and fn.name() in _PASS_THROUGH:
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
    return fn is not None and fn.name() == "torch::autograd::AccumulateGrad"


def _row_dims(shape: torch.Size) -> tuple[int, ...]:
    """The trailing dims that make up one row of at least ``_ROW`` elements (all of them for a
    tensor smaller than that)."""
    size = 1
    for k in range(1, len(shape) + 1):
        size *= shape[-k]
        if size >= _ROW:
            return tuple(range(-k, 0))
    return tuple(range(-len(shape), 0))


class _Packed:
    """A saved tensor in its narrow form, with what unpacking needs to restore it: a 16-bit
    copy, or FP8 rows with their scales (:func:`_to_fp8`)."""

    __slots__ = ("data", "dtype", "shape", "version")

    def __init__(self, data: Any, t: Tensor) -> None:
        self.data, self.dtype, self.shape, self.version = data, t.dtype, t.shape, t._version

    def unpack(self) -> Tensor:
        if isinstance(self.data, Tensor):
            return self.data.to(self.dtype)
        return dequantize_2d(self.data, self.dtype).view(self.shape)


def _to_fp8(t: Tensor) -> Float8Data:
    """``t`` as FP8 rows of its trailing dims (:func:`_row_dims`), one power-of-2 scale a row.

    On a CPU in eager mode packed and unpacked in slices of rows whose temporaries stay in
    cache (:func:`~mixprec.fp8.quantization.quantize_2d`): whole 12 MB activations went at half
    the speed of 2**18-element slices (EPYC, 1 thread)."""
    width = math.prod(t.shape[d] for d in _row_dims(t.shape))
    return quantize_2d(t.detach().reshape(-1, width), E4M3, -1, power_of_2=True)


class _Recomputed:
    """A saved activation output, rebuilt in backward from the input its own node keeps."""

    __slots__ = ("base", "dtype", "geometry", "node", "version")

    def __init__(self, node: Any, base: Tensor, t: Tensor) -> None:
        self.node, self.dtype, self.version = node, t.dtype, t._version
        self.geometry = (t.shape, t.stride(), t.storage_offset() - base.storage_offset())
        self.base = weakref.ref(base)

    def unpack(self) -> Tensor:
        base = self.base()
        if base is not None and base._version != self.version:
            raise RuntimeError(
                "A tensor saved for backward was modified in place after it was saved "
                f"({self.node.name()}'s output); mixprec's activations=... recompute cannot "
                "rebuild it. Avoid the in-place op, or pass ActivationConfig(recompute=False)."
            )
        with torch.no_grad():
            out = _RECOMPUTE[self.node.name()](self.node, self.node._saved_self)
        return out.to(self.dtype).as_strided(*self.geometry)


class SavedTensorStorage(torch.autograd.graph.saved_tensors_hooks):
    """``with SavedTensorStorage(config, compute_dtype): forward`` -- the hooks themselves.

    ``compute_dtype`` is where ``storage="16-bit"`` puts float32 tensors.
    """

    def __init__(self, config: ActivationConfig, compute_dtype: torch.dtype) -> None:
        self.config = config
        self.low = compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else None
        self._seen: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        super().__init__(self._pack, _unpack)

    def _wanted(self, t: Tensor) -> bool:
        if t.dtype not in _FLOATS or t.numel() < self.config.min_numel:
            return False
        if t.grad_fn is None and not t.requires_grad:
            return False  # no history: the input batch, a frozen weight
        if t.numel() * t.element_size() > t.untyped_storage().nbytes():
            return False  # expanded: a dense copy would be larger
        return not _is_weight(t)

    def _pack(self, t: Tensor) -> Any:
        if not self._wanted(t):
            return t
        hit = self._seen.get(t)
        if hit is not None and hit.version == t._version:
            return hit
        packed = self._recipe(t) if self.config.recompute else None
        storage = self.config.storage
        if packed is not None:
            pass
        elif storage == "fp8":
            packed = _Packed(_to_fp8(t), t)
        elif storage == "16-bit" and self.low is not None and t.dtype == torch.float32:
            packed = _Packed(t.detach().to(self.low), t)
        else:
            return t
        self._seen[t] = packed
        return packed

    @staticmethod
    def _recipe(t: Tensor) -> _Recomputed | None:
        """A recomputation for ``t`` if it is (a view of) the output of an op in
        ``_RECOMPUTE`` that was not modified in place since."""
        base = t if t._base is None else t._base
        node = base.grad_fn
        if node is None or node.name() not in _RECOMPUTE or t._version != 0:
            return None
        if not base.is_contiguous():  # rebuilt contiguous: the view must find its elements
            return None
        return _Recomputed(node, base, t)


def _unpack(saved: Any) -> Tensor:
    return saved.unpack() if isinstance(saved, (_Packed, _Recomputed)) else saved
