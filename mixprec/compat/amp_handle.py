"""Apex's pre-2019 handle API on mixprec: ``handle = amp.init()``, ``handle.scale_loss``,
``handle.wrap_optimizer``.

Design (``docs/design.md``, "Compatibility layers"): Apex's ``amp.init`` monkeypatched torch's
functions for the whole process and returned a handle that undid the patches in
``_deactivate()``. Here the handle holds a mixprec eager region instead -- a
:class:`mixprec.autocast` region in float16, entered by ``amp.init`` and left by
``_deactivate()`` -- so every op run meanwhile follows mixprec's cast table, as Apex's patched
functions did, and nothing in torch is patched. Loss scaling is mixprec's own machinery:

* ``handle.scale_loss(loss, optimizer)`` wraps the torch optimizer (once) in a
  :class:`~mixprec._core.optimizer.MixedPrecisionOptimizer` without masters that shares the
  handle's loss scaler. On exit the gradients are unscaled and checked in one fused pass, and
  the optimizer's next ``step()`` goes through the wrapper (a one-shot redirect of the
  instance's ``step``, as Apex's skip was): it reads the verdict with one host sync, updates
  the scaler, and skips the update on inf/NaN.
* ``handle.wrap_optimizer(optimizer, num_loss)`` returns an :class:`OptimWrapper`:
  ``with opt.scale_loss(loss)`` once per loss, each loss with its own dynamic scaler (Apex's
  ``num_loss``), then ``opt.step()``, skipped when any of those losses overflowed.
* Gradient accumulation is exact: each backward is unscaled with its own scale (mixprec's
  stash-and-add), where Apex's old API unscaled earlier gradients again.
* torch's autocast cache keeps one 16-bit copy of each weight while the region is open; it is
  cleared after every ``scale_loss`` and every step (Apex cleared its cache at the same points),
  so an updated weight is never served stale.

Differences from Apex, none of which a caller has to change for:

* The region belongs to the thread that called ``amp.init`` (Apex's patches were process-wide).
  Handles nest; deactivate them in reverse order.
* The scalers are updated once per step with that step's verdict (Apex: once per backward), and
  dynamic scaling has a floor of 1.0.
* ``verbose=True`` does not print each cast: ``mixprec.numerics.op_stats()`` counts what ran in
  which
  dtype. ``allow_banned`` is accepted: ``binary_cross_entropy`` runs in float32 in any case.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

import mixprec
from mixprec._core import _frames, engine
from mixprec._core._gradients import LossSlot
from mixprec._core.loss_scale import LossScaler
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._core.update.choice import UpdatePlan

__all__ = ["AmpHandle", "NoOpHandle", "OptimWrapper", "apex_scaler", "step_without_casts"]


def apex_scaler(loss_scale: Any = "dynamic") -> LossScaler:
    """Apex's ``LossScaler(loss_scale)``: dynamic from 2**16, x2 after 2000 clean steps, /2 on
    overflow, at most 2**24; or a static scale."""
    if loss_scale == "dynamic":
        return LossScaler(2.0**16, growth_interval=2000, max_scale=2.0**24)
    try:
        scale = float(loss_scale)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be 'dynamic' or a number; received {loss_scale!r}."
        ) from None
    return LossScaler.from_spec(scale)


def step_without_casts(step: Callable[[], Any]) -> Any:
    """Run an optimizer step with casts off (Apex did too: the update is fp32 arithmetic), then
    drop the 16-bit weight copies an enclosing region cached: the weights just changed."""
    if not engine.is_active():
        return step()
    with mixprec.autocast("float32"):
        result = step()
    torch.clear_autocast_cache()
    return result


def _overflow_message(opt: MixedPrecisionOptimizer, verbosity: int) -> None:
    if opt.step_skipped and verbosity >= 1:
        print("Gradient overflow, skipping update")


class AmpHandle:
    """What ``amp.init()`` returns: an open float16 mixprec region plus a loss scaler.

    ``amp.initialize(..., opt_level="O1")`` opens one too (``amp._amp_state.handle``), with the
    models it initialized: its ``_deactivate()`` also removes their O1 boundaries.
    """

    def __init__(
        self,
        loss_scale: Any = "dynamic",
        enable_caching: bool = True,
        verbose: bool = False,
        *,
        dtype: torch.dtype = torch.float16,
        region: bool = True,
        models: list[nn.Module] | None = None,
        verbosity: int = 1,
    ) -> None:
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)
        self._verbosity = verbosity
        self._default_slot: LossSlot | None = LossSlot(apex_scaler(loss_scale))
        self._wrapped: weakref.WeakKeyDictionary[Optimizer, MixedPrecisionOptimizer] = (
            weakref.WeakKeyDictionary()
        )
        self._models = list(models or [])
        self._casts_on = True
        self._region: mixprec.autocast | None = None
        if region:
            self._region = mixprec.autocast(dtype, cache_enabled=self._enable_caching)
            self._region.__enter__()
        self._live = True

    # -- Apex's handle surface ---------------------------------------------------------------
    def is_active(self) -> bool:
        """True until ``_deactivate()``, except inside ``_disable_casts()``."""
        return self._live and self._casts_on

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        """Ops run in their inputs' dtypes inside the block (a float32 region on top)."""
        self._casts_on = False
        try:
            with mixprec.autocast("float32"):
                yield
        finally:
            self._casts_on = True

    def wrap_optimizer(self, optimizer: Optimizer, num_loss: int = 1) -> OptimWrapper:
        """An :class:`OptimWrapper` with ``num_loss`` loss scalers; after this, losses are
        scaled with ``optimizer.scale_loss(loss)`` (as in Apex)."""
        self._default_slot = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor, optimizer: Optimizer) -> Iterator[Tensor]:
        """``with handle.scale_loss(loss, optimizer) as scaled: scaled.backward()``; the next
        ``optimizer.step()`` is skipped if a gradient came out inf/NaN."""
        if not self.is_active():
            yield loss
            return
        if self._default_slot is None:
            raise RuntimeError(
                "After calling `handle.wrap_optimizer()`, you must explicitly use "
                "`optimizer.scale_loss(loss)`."
            )
        mixed = self._mixed_for(optimizer, self._default_slot)
        with mixprec.scale_loss(loss.float(), mixed) as scaled:
            yield scaled
        self._route_next_step(optimizer, mixed)
        self._clear_cache()

    def _mixed_for(self, optimizer: Optimizer, slot: LossSlot) -> MixedPrecisionOptimizer:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError(
                "handle.scale_loss takes the plain torch optimizer; this one is already "
                "wrapped by mixprec (use its own backward / mixprec.scale_loss)."
            )
        mixed = self._wrapped.get(optimizer)
        if mixed is None:
            mixed = MixedPrecisionOptimizer(optimizer, [slot], UpdatePlan(masters=False))
            self._wrapped[optimizer] = mixed
        return mixed

    def _route_next_step(self, optimizer: Optimizer, mixed: MixedPrecisionOptimizer) -> None:
        """Send the optimizer's next ``step()`` through ``mixed`` (once), which acts on the
        verdicts recorded since the last step."""
        current = optimizer.__dict__.get("step")
        if getattr(current, "_mixprec_amp_route", False):
            return
        had = "step" in optimizer.__dict__  # e.g. an LR scheduler's step counter wrapper

        def step(closure: Callable[[], Any] | None = None) -> Any:
            if had:
                optimizer.step = current  # type: ignore[method-assign]
            else:
                del optimizer.step
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            step_without_casts(mixed.step)  # calls optimizer.step() unless the step is skipped
            _overflow_message(mixed, self._verbosity)
            return loss

        step._mixprec_amp_route = True  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]

    def _clear_cache(self) -> None:
        """Drop the 16-bit weight copies cached in the region (weights may change next)."""
        if self._region is not None:
            torch.clear_autocast_cache()

    def remove_cache(self, param: Tensor) -> None:
        """Apex drops one parameter's cached cast; torch's cache is cleared as a whole."""
        if self.has_cache:
            self._clear_cache()

    @property
    def has_cache(self) -> bool:
        return self._enable_caching and self._region is not None

    @property
    def verbose(self) -> bool:
        return self._verbose

    def _deactivate(self) -> None:
        """Close the region (``amp.init``) or remove the O1 casting from the models
        (``amp.initialize``); a second call does nothing."""
        if not self._live:
            return
        if self._region is not None:
            frame = self._region._stack[-1][0] if self._region._stack else None
            if frame is None or _frames.top() is not frame:
                raise RuntimeError(
                    "amp handles were deactivated out of order, or from another thread: "
                    "deactivate the most recently created handle (amp.init) first, on the "
                    "thread that created it."
                )
            self._region.__exit__(None, None, None)
        for m in self._models:
            engine.remove_boundary(m)
        self._live = False


class NoOpHandle(AmpHandle):
    """``amp.init(enabled=False)``: no casts, losses pass through unscaled."""

    def __init__(self) -> None:
        super().__init__(enable_caching=False, region=False)
        self._live = False


class OptimWrapper:
    """``handle.wrap_optimizer(optimizer, num_loss)``: one dynamic loss scaler per loss.

    Call ``with opt.scale_loss(loss) as scaled: scaled.backward()`` once for each of the
    ``num_loss`` losses, then ``opt.step()``; every other attribute is the wrapped optimizer's.
    ``state_dict()`` is in torch's layout (the wrapped optimizer loads it) with the scalers'
    state beside it under ``"mixprec"``.
    """

    def __init__(self, optimizer: Optimizer, amp_handle: AmpHandle, num_loss: int = 1) -> None:
        if not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be an int >= 1, received {num_loss!r}.")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        slots = [LossSlot(apex_scaler("dynamic")) for _ in range(num_loss)]
        self._mixed = MixedPrecisionOptimizer(optimizer, slots, UpdatePlan(masters=False))

    @contextlib.contextmanager
    def scale_loss(self, loss: Tensor) -> Iterator[Tensor]:
        """Scale ``loss`` with the scaler of the next loss since the last ``step()``."""
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(
                f"scale_loss was called {self._loss_idx + 1} times since the last step, but "
                f"this wrapper has num_loss={self._num_loss}: pass num_loss to "
                "handle.wrap_optimizer."
            )
        with mixprec.scale_loss(loss.float(), self._mixed, loss_id=self._loss_idx) as scaled:
            yield scaled
        self._loss_idx += 1
        self._amp_handle._clear_cache()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step, or skip if a loss scaled since the last step overflowed."""
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        if closure is not None:
            raise NotImplementedError(
                "The `closure` argument is unsupported by the amp optimizer wrapper."
            )
        self._loss_idx = 0
        result = step_without_casts(self._mixed.step)
        _overflow_message(self._mixed, self._amp_handle._verbosity)
        return result

    @property
    def step_skipped(self) -> bool:
        """True when the last ``step()`` was skipped for an inf/NaN gradient."""
        return self._mixed.step_skipped

    def loss_scale(self, loss_id: int = 0) -> float:
        """The current scale of loss ``loss_id``."""
        return self._mixed.slot(loss_id).scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._mixed.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._mixed.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self._mixed.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._mixed.load_state_dict(state_dict)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in ("_optimizer", "_mixed"):
            raise AttributeError(attr)
        return getattr(self._optimizer, attr)

    def __repr__(self) -> str:
        return f"OptimWrapper({self._optimizer!r}, num_loss={self._num_loss})"
