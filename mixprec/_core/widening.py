"""Storage-only precision: 16-bit weights at rest, every forward and backward op in float32.

``Recipe(..., weights="16-bit", compute="fp32")`` (e.g. ``Recipe("lean", torch.bfloat16,
compute="fp32")``) keeps a recipe's storage -- 16-bit weights and, under an update mode, its
optimizer states and update, unchanged -- on hosts where 16-bit matmuls are slow (a CPU
without AVX512_BF16 emulates them). Design:

* **Widened per module, for its forward only.** A forward pre-hook puts ``param.float()`` in
  place of each of the module's own 16-bit parameters, the forward hook puts the parameter
  back; the widened copy is dropped when the module returns. The cast is torch's own
  differentiable ``to``, so the gradient reaches the parameter in its 16-bit dtype, as an
  update mode expects, and the post-accumulate-grad hooks of released gradients fire as
  before. Per module rather than per op: the module reads ``self.weight`` from its
  ``_parameters``, whatever ops its forward runs.
* **Saved as the parameter itself.** A GEMM saves its fp32 weight operand for backward; kept,
  that would be an fp32 copy of every weight until backward (+4 bytes per parameter). The
  saved-tensor hooks here (:class:`WideningStorage`, around the model's forward) pack a widened
  weight (or a view of it) as a reference to its 16-bit parameter and widen it again when
  backward reads it -- exact, since widening is lossless. A parameter changed in place between
  the forward and that read is refused, as autograd refuses a stale saved tensor.
* **What is not seen**: a parameter read by a module other than its own (a parent's
  ``F.linear(x, self.child.weight)``) reaches its op in 16 bits next to fp32 activations, and
  torch raises its dtype-mismatch error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from mixprec._core.activations import _unpack as _unpack_activation

__all__ = ["WideningStorage", "install_widening"]

_LOW = (torch.float16, torch.bfloat16)
_HOOKS_ATTR = "_mixprec_widening"


class _Widened:
    """A saved (view of a) widened weight, held as its 16-bit parameter and the view's geometry."""

    __slots__ = ("geometry", "param", "version")

    def __init__(self, param: Tensor, base: Tensor, t: Tensor) -> None:
        self.param, self.version = param, param._version
        self.geometry = (t.shape, t.stride(), t.storage_offset() - base.storage_offset())

    def unpack(self) -> Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                "A 16-bit weight saved for backward was modified in place after the forward "
                f"(shape {tuple(self.param.shape)}); storage-only precision re-widens it in "
                "backward and cannot. Step the optimizer after backward, not inside it."
            )
        with torch.no_grad():
            wide = self.param.detach().to(torch.float32)
        return wide.as_strided(*self.geometry)


#: widened copy -> its parameter, for the forward now running (weak: dropped with the copy)
_widened: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _widen(module: nn.Module, args: Any) -> None:
    saved = {}
    for name, p in module._parameters.items():
        if p is not None and p.dtype in _LOW:
            wide = p.to(torch.float32)
            _widened[wide] = p
            saved[name] = p
            module._parameters[name] = wide
    module.__dict__[_HOOKS_ATTR] = saved


def _restore(module: nn.Module, args: Any, output: Any) -> None:
    module._parameters.update(module.__dict__.pop(_HOOKS_ATTR, {}))


def install_widening(model: nn.Module) -> None:
    """Give each module of ``model`` with 16-bit parameters of its own the widening hooks."""
    for module in model.modules():
        if any(p is not None and p.dtype in _LOW for p in module._parameters.values()):
            module.register_forward_pre_hook(_widen)
            module.register_forward_hook(_restore, always_call=True)


class WideningStorage(torch.autograd.graph.saved_tensors_hooks):
    """``with WideningStorage(inner): forward`` -- widened weights saved as their parameters;
    every other saved tensor goes to ``inner`` (the ``activations=`` storage) or is kept."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        base = t if t._base is None else t._base
        param = _widened.get(base) if base.dtype == torch.float32 else None
        if param is not None:
            return _Widened(param, base, t)
        return t if self.inner is None else self.inner._pack(t)

    def _unpack(self, saved: Any) -> Tensor:
        if isinstance(saved, _Widened):
            return saved.unpack()
        return saved if self.inner is None else _unpack_activation(saved)
