"""A ``torch.optim.Optimizer`` face for optimizer *wrappers* that are not one (``LARC(SGD(...))``).

Design (``docs/design.md``, "Compatibility layers"): an ``Optimizer`` subclass whose groups,
state and methods are the wrapper's own objects, so the masters mixprec puts into
``param_groups`` are what the wrapper steps (LARC rescales the masters' fp32 gradients).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["REQUIRED", "OptimizerView", "as_torch_optimizer"]

#: What an object needs to be used as an optimizer.
REQUIRED = ("param_groups", "state", "step")


class OptimizerView(Optimizer):
    """``Optimizer`` view of ``wrapper``: every call and attribute goes to the wrapper."""

    def __init__(self, wrapper: Any) -> None:  # no super().__init__: the groups are the wrapper's
        self.wrapper = wrapper
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())

    param_groups = property(
        lambda self: self.wrapper.param_groups,
        lambda self, v: setattr(self.wrapper, "param_groups", v),
    )
    state = property(lambda self: self.wrapper.state)

    @property
    def defaults(self) -> dict[str, Any]:
        own = getattr(self.wrapper, "defaults", None)
        if own is None:  # e.g. a wrapper with only .optimizer: the inner one's defaults
            own = getattr(getattr(self.wrapper, "optimizer", None), "defaults", None)
        return own if own is not None else {}

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"OptimizerView({self.wrapper!r})"

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self.wrapper.step() if closure is None else self.wrapper.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if hasattr(self.wrapper, "zero_grad"):
            self.wrapper.zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if hasattr(self.wrapper, "state_dict"):
            return self.wrapper.state_dict()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if hasattr(self.wrapper, "load_state_dict"):
            self.wrapper.load_state_dict(state_dict)
        else:
            super().load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self.wrapper, "add_param_group"):
            raise NotImplementedError(
                f"{type(self.wrapper).__name__} has no add_param_group; add the group to the "
                "optimizer it wraps before passing it to initialize."
            )
        self.wrapper.add_param_group(param_group)


def as_torch_optimizer(obj: Any, what: str = "amp.initialize") -> Optimizer:
    """``obj`` itself if it is a torch optimizer, an :class:`OptimizerView` of it if it is an
    optimizer wrapper, else a TypeError that says what is missing."""
    if isinstance(obj, Optimizer):
        return obj
    missing = [name for name in REQUIRED if not hasattr(obj, name)]
    if missing:
        raise TypeError(
            f"{what} takes torch.optim.Optimizer objects or optimizer wrappers that expose "
            f"{', '.join(REQUIRED)} (like apex.parallel.LARC); received "
            f"{type(obj).__name__}, which has no {', '.join(missing)}."
        )
    return OptimizerView(obj)
