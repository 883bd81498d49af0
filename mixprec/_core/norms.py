"""What counts as a normalization layer: one rule, :func:`is_norm`, for every part of mixprec
that keeps norms fp32 (O2 storage, ``for_inference``, FSDP2 sharding, the graph pass): classes
registered with :func:`register_norm`, torch's norm classes, then a leaf module whose class name
ends in ``"Norm"`` with 1-D parameters.
Design: ``docs/design.md``, "One training step through the code".
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
