"""LARC: layer-wise adaptive rate control around any torch optimizer (``apex.parallel.LARC``).

Design (``docs/design.md``, "Compatibility layers"): Apex shipped LARC next to ``amp`` and its
users pass ``LARC(SGD(...))`` to ``amp.initialize``; the shim's ``install()`` makes
``from apex.parallel.LARC import LARC`` resolve here. Like Apex's, it is an optimizer *wrapper*,
not a ``torch.optim.Optimizer`` subclass: it rescales each parameter's gradient, then lets the
inner optimizer step. The rule (You, Gitman and Ginsburg, "Large Batch Training of
Convolutional Networks", 2017), per parameter ``w`` with gradient ``g`` in a group with
learning rate ``lr`` and weight decay ``wd``::

    local = trust_coefficient * |w| / (|g| + wd * |w| + eps)     (1 where |w| or |g| is 0)
    clip=True:  local = min(local / lr, 1)   # the group lr stays an upper bound
    g <- (g + wd * w) * local                # weight decay folded in here ...
    inner step with weight_decay = 0         # ... so the inner optimizer must not add it again

The norms are float32 reductions kept on the device (no host sync per parameter); the
weight-decay values are put back after the step, also when it raises. Apex applied weight
decay only where both norms were nonzero; here it always is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["LARC"]


class LARC:
    """``LARC(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8)``, Apex's signature.

    Use it where the optimizer was used: ``param_groups``, ``state``, ``step``, ``zero_grad``,
    ``state_dict``/``load_state_dict`` and ``add_param_group`` are the inner optimizer's.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"LARC wraps a torch.optim.Optimizer, received {type(optimizer).__name__}."
            )
        if not trust_coefficient > 0 or not eps >= 0:
            raise ValueError(
                f"trust_coefficient must be > 0 and eps >= 0; received "
                f"trust_coefficient={trust_coefficient!r}, eps={eps!r}."
            )
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = bool(clip)
        self.eps = float(eps)

    @property
    def optimizer(self) -> Optimizer:
        return self.optim

    param_groups = property(
        lambda self: self.optim.param_groups,
        lambda self, v: setattr(self.optim, "param_groups", v),
    )
    state = property(lambda self: self.optim.state, lambda self, v: setattr(self.optim, "state", v))
    defaults = property(lambda self: self.optim.defaults)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip})"

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _rescale(self, group: dict[str, Any]) -> None:
        wd, lr = float(group.get("weight_decay", 0.0)), float(group["lr"])
        for p in group["params"]:
            g = p.grad
            if g is None or g.is_sparse:
                continue
            w_norm = torch.linalg.vector_norm(p, dtype=torch.float32)
            g_norm = torch.linalg.vector_norm(g, dtype=torch.float32)
            local = self.trust_coefficient * w_norm / (g_norm + wd * w_norm + self.eps)
            if self.clip:
                local = torch.clamp(local / lr, max=1.0)
            local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
            if wd:
                g.add_(p, alpha=wd)
            g.mul_(local.to(g.dtype))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale every gradient by its layer's trust ratio, then step the inner optimizer.

        A ``closure`` is evaluated first (it recomputes the gradients), then the step runs.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = []
        for group in self.optim.param_groups:
            decays.append(group.get("weight_decay", 0.0))
            self._rescale(group)
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            self.optim.step()
            return loss
        finally:
            for group, wd in zip(self.optim.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = wd
