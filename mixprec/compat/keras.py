"""Keras-style loss scaling for custom PyTorch training loops:
``mixprec.compat.keras.LossScaleOptimizer``.

Design (``docs/design.md``, "Compatibility layers"): the tf-keras API that the Keras mixed-precision
guide teaches -- ``get_scaled_loss``, ``get_unscaled_gradients``, ``apply_gradients`` -- wrapped
around any ``torch.optim.Optimizer``, so the guide's custom loop ports line by line
(``tape.gradient`` becomes ``torch.autograd.grad``). Keras' dynamic rule is reproduced exactly
on top of :class:`mixprec._core.loss_scale.LossScaler`: start at ``initial_scale`` (2**15), double
after
``dynamic_growth_steps`` (2000) consecutive finite steps, halve on a non-finite one, never below
1 (tf-keras' floor). ``apply_gradients`` checks every gradient with one fused kernel and one host
sync; a non-finite step leaves parameters and optimizer state untouched.

Choices where Keras' two versions (tf-keras and Keras 3) differ: ``iterations`` counts
applied steps only (Keras 3: a skipped step does not advance the schedule); the misuse warning
of tf-keras is kept. PyTorch additions: ``step()`` for loops that call
``get_scaled_loss(loss).backward()`` (gradients in ``.grad`` are unscaled there), ``zero_grad``,
``state_dict``/``load_state_dict``, and ``param_groups`` delegation for LR schedulers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec._core._warnings import MixprecWarning
from mixprec._core.loss_scale import LossScaler, unscale_and_check_

__all__ = ["LossScaleOptimizer"]

_LOW = (torch.float16, torch.bfloat16)
_MAX_SCALE = 2.0**127  # tf-keras grows only while the result stays finite in float32


class LossScaleOptimizer:
    """Wrap ``optimizer`` with Keras' loss scaling.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        dynamic: True (default) adjusts the scale; False keeps ``initial_scale`` fixed.
        initial_scale: the starting (or fixed) loss scale, default ``2**15`` as in Keras.
        dynamic_growth_steps: finite steps between doublings, default 2000.

    Example (the Keras guide's ``train_step``)::

        scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = torch.autograd.grad(scaled_loss, params)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, params))
    """

    def __init__(
        self,
        optimizer: Optimizer,
        dynamic: bool = True,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
    ) -> None:
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError("LossScaleOptimizer cannot wrap another LossScaleOptimizer.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f'"optimizer" must be a torch.optim.Optimizer, but got: {type(optimizer).__name__}.'
            )
        if not isinstance(dynamic, bool):
            raise TypeError(
                f'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, '
                f"but got: {dynamic!r}"
            )
        if getattr(optimizer, "_mixprec_loss_scale_optimizer", False):
            raise ValueError(
                '"optimizer" is already wrapped by a LossScaleOptimizer; wrap each optimizer once.'
            )
        self.inner_optimizer = optimizer
        self.dynamic = dynamic
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = int(dynamic_growth_steps)
        if dynamic:
            self._scaler = LossScaler(
                self.initial_scale,
                growth_interval=self.dynamic_growth_steps,
                min_scale=min(1.0, self.initial_scale),
                max_scale=max(_MAX_SCALE, self.initial_scale),
            )
        else:
            self._scaler = LossScaler(self.initial_scale, dynamic=False)
        self.iterations = 0
        self._scaled = self._unscaled = False
        self._warned = False
        optimizer._mixprec_loss_scale_optimizer = True  # type: ignore[attr-defined]

    # -- Keras properties ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._scaler.scale

    @property
    def dynamic_counter(self) -> int:
        """Consecutive finite steps since the scale last changed (Keras' ``good_steps``)."""
        return self._scaler.growth_tracker

    @property
    def learning_rate(self) -> float:
        return self.inner_optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        for group in self.inner_optimizer.param_groups:
            group["lr"] = value

    lr = learning_rate
    param_groups = property(lambda self: self.inner_optimizer.param_groups)
    state = property(lambda self: self.inner_optimizer.state)

    @property
    def skipped_steps(self) -> int:
        return self._scaler.skipped_steps

    @property
    def step_skipped(self) -> bool:
        return bool(self._scaler.last_step_skipped)

    def get_config(self) -> dict[str, Any]:
        return {
            "inner_optimizer": type(self.inner_optimizer).__name__,
            "dynamic": self.dynamic,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({type(self.inner_optimizer).__name__}, loss_scale="
            f"{self.loss_scale}, dynamic={self.dynamic})"
        )

    # -- scaling ---------------------------------------------------------------------------
    def get_scaled_loss(self, loss: Tensor | Any) -> Tensor:
        """``loss * loss_scale``, computed in at least float32 (a 16-bit loss would overflow).

        ``loss`` may be a callable returning the loss, as in tf-keras.
        """
        if callable(loss) and not isinstance(loss, Tensor):
            loss = loss()
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"get_scaled_loss expects a tensor (or a callable returning one); "
                f"received {type(loss).__name__}."
            )
        self._scaled = True
        if loss.dtype in _LOW:
            loss = loss.float()
        return loss * self._scaler.scale

    def get_unscaled_gradients(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Each gradient divided by the loss scale (None stays None; 16-bit ones come back fp32,
        where dividing cannot underflow)."""
        self._unscaled = True
        inv = 1.0 / self._scaler.scale
        out: list[Tensor | None] = []
        for g in grads:
            if g is None:
                out.append(None)
            else:
                out.append((g.float() if g.dtype in _LOW else g) * inv)
        return out

    # -- stepping --------------------------------------------------------------------------
    @torch.no_grad()
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> bool:
        """Apply (already unscaled) gradients if all are finite; update the loss scale.

        Returns True if the step was applied, False if it was skipped.
        """
        pairs = [(g, v) for g, v in grads_and_vars]
        if not (self._scaled and self._unscaled) and not self._warned and self.dynamic:
            self._warned = True
            warnings.warn(
                "You forgot to call LossScaleOptimizer.get_scaled_loss() and "
                "LossScaleOptimizer.get_unscaled_gradients() before calling "
                "LossScaleOptimizer.apply_gradients(): the loss is not being scaled.",
                MixprecWarning,
                stacklevel=2,
            )
        self._scaled = self._unscaled = False
        grads = [g for g, _ in pairs if g is not None]
        finite = self._all_finite(grads, 1.0)
        if finite:
            saved = [v.grad for _, v in pairs]
            for g, v in pairs:
                v.grad = None if g is None else g.to(v.dtype)
            self.inner_optimizer.step()
            for (_, v), old in zip(pairs, saved):
                v.grad = old
            self.iterations += 1
        self._scaler.update(not finite)
        return finite

    @torch.no_grad()
    def step(self) -> bool:
        """PyTorch-style step after ``get_scaled_loss(loss).backward()``: unscale ``.grad``,
        skip on inf/NaN, update the scale. Returns True if the step was applied."""
        params = [
            p for g in self.inner_optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        finite = self._all_finite([p.grad for p in params], 1.0 / self._scaler.scale)
        self._scaled = self._unscaled = False
        if finite:
            self.inner_optimizer.step()
            self.iterations += 1
        else:
            for p in params:
                p.grad = None
        self._scaler.update(not finite)
        return finite

    def minimize(self, loss: Tensor, var_list: Sequence[Tensor]) -> bool:
        """Scale, differentiate, unscale and apply in one call (tf-keras ``minimize``)."""
        var_list = list(var_list)
        grads = torch.autograd.grad(self.get_scaled_loss(loss), var_list, allow_unused=True)
        return self.apply_gradients(zip(self.get_unscaled_gradients(grads), var_list))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _all_finite(grads: list[Tensor], inv_scale: float) -> bool:
        """Unscale in place (unless ``inv_scale`` is 1) and check, one host sync per device."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        flags = []
        for device, group in by_device.items():
            flag = torch.zeros(1, device=device)
            unscale_and_check_(group, inv_scale, flag)
            flags.append(flag)
        return not any(bool(f.item()) for f in flags)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "loss_scale": self._scaler.state_dict(),
            "iterations": self.iterations,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner_optimizer.load_state_dict(state_dict["inner_optimizer"])
        self._scaler.load_state_dict(state_dict["loss_scale"])
        self.iterations = int(state_dict["iterations"])
