"""The process-wide state of Apex's ``amp`` (``amp._amp_state``) and its loss-scaler views.

Design: Apex keeps one global state per process -- the latest ``amp.initialize`` call's loss
scalers, options and O1 handle -- which ported code and Apex's own tests read
(``amp._amp_state.loss_scalers[0].loss_scale()``). The shim keeps the same object, with views
over mixprec's scalers instead of Apex's.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

from mixprec._core._gradients import LossSlot
from mixprec.compat.amp_handle import AmpHandle

__all__ = ["AmpState"]


class _ScalerView:
    """Apex's ``LossScaler`` surface over one of mixprec's loss scalers: ``loss_scale()``,
    ``_loss_scale`` (settable, as Apex's tests set it) and ``_unskipped``."""

    def __init__(self, slot: LossSlot) -> None:
        self._slot = slot

    def loss_scale(self) -> float:
        return self._slot.scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self._slot.scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._slot.scaler.scale = float(value)

    @property
    def _unskipped(self) -> int:
        return self._slot.scaler.growth_tracker

    @property
    def dynamic(self) -> bool:
        return self._slot.scaler.dynamic

    def __repr__(self) -> str:
        return f"LossScaler view of {self._slot.scaler!r}"


class AmpState:
    """Apex's process-global ``_amp_state`` (``amp._amp_state``): the latest call's scalers,
    options and handle."""

    def __init__(self) -> None:
        self.initialized = False
        self.enabled = True
        self.verbosity = 1
        self.slots: list[LossSlot] = []
        self.wrappers: weakref.WeakValueDictionary[int, Any] = (
            weakref.WeakValueDictionary()
        )  # id(optimizer the caller passed) -> returned optimizer
        self.opt_properties: types.SimpleNamespace | None = None
        self.handle: AmpHandle | None = None
        self.handles: list[AmpHandle] = []  # from amp.init, deactivated by reset() in reverse
        self.allow_incoming_model_not_fp32 = False
        self.hard_override = False

    @property
    def loss_scalers(self) -> list[_ScalerView]:
        return [_ScalerView(slot) for slot in self.slots]
