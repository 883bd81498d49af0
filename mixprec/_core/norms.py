"""What counts as a normalization layer: one rule for every part of mixprec that keeps norms fp32.

O2 stores a model in 16-bit but keeps its norm layers' weights in float32 (their scale and shift
act on normalized values near 1, where 16-bit resolution is coarse); for_inference, FSDP2
sharding and the graph pass's O2 storage make the same choice. They all ask :func:`is_norm`.

The rule, in order:
1. a class registered with :func:`register_norm` (``register_norm(cls, False)`` opts out);
2. torch's norm classes: batch/instance norms, ``LayerNorm``, ``GroupNorm``,
   ``LocalResponseNorm``, ``RMSNorm``;
3. by structure: a leaf module (no child modules) whose class name ends in ``"Norm"`` and whose
   parameters are all 1-D. This catches the hand-written norms of Hugging Face models
   (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm``, ``T5LayerNorm``,
   ...) without a list of model families, and leaves out containers such as a ``PreNorm``
   wrapper (it has children) and projections named ``...Norm`` with a matrix weight.
Why a name and not only the computation: a norm's forward is arbitrary Python (``x.pow(2)
.mean(-1)``, ``rsqrt``, a learned scale), which module-level code cannot see without tracing;
the suffix is the convention every library follows, and :func:`register_norm` covers the rest.
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_norm", "register_norm"]

_TORCH_NORMS: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_registered: dict[type, bool] = {}


def register_norm(cls: type, is_norm: bool = True) -> type:
    """Declare that modules of class ``cls`` (and its subclasses) are norms, or are not.

    Usable as a decorator: ``@mixprec.register_norm class MyScaleNorm(nn.Module): ...``.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_norm expects an nn.Module subclass, received {cls!r}.")
    if not isinstance(is_norm, bool):
        raise TypeError(f"is_norm must be True or False, received {is_norm!r}.")
    _registered[cls] = is_norm
    return cls


def is_norm(module: nn.Module) -> bool:
    """True when ``module`` is a normalization layer under the rule above."""
    for cls in type(module).__mro__:
        if cls in _registered:
            return _registered[cls]
    if isinstance(module, _TORCH_NORMS):
        return True
    if not type(module).__name__.endswith("Norm") or next(module.children(), None) is not None:
        return False
    return all(p.dim() == 1 for p in module.parameters(recurse=False))
