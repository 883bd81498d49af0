"""The checkpoint half of :class:`~mixprec._core.optimizer.MixedPrecisionOptimizer`.

Design: ``state_dict()`` is torch's layout, so the torch optimizer the wrapper holds (or a
plain one over the fp32 model) loads it as it is, and mixprec's own state (the masters' exact
values, the loss scalers, the skip counters, an update mode's compensation and rounding step count)
travels inside it, under ``param_groups[0]["mixprec"]``, which
``torch.optim.Optimizer.load_state_dict`` keeps. Where that state lives and how either load
order resumes is :mod:`mixprec._core.resume`; this mixin writes and reads it, checking the
layout and the counts of masters and scalers before anything is written.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._core.recipe_change import adapt, announce
from mixprec._core.resume import (
    MIXPREC_KEY,
    drop_stale,
    pack_state_dict,
    split_state_dict,
    state_steps,
)
from mixprec._core.update.state_codes import fp32_optimizer_state_dict

__all__ = ["CheckpointState"]


class CheckpointState:
    """``state_dict`` and ``load_state_dict`` of the mixed-precision optimizer (a mixin: it
    reads the optimizer's ``optimizer``, ``_pairs``, ``slots``, ``lean`` and counters)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, so the torch optimizer this wraps (or a plain one over the fp32
        model) loads it as it is: the inner optimizer's ``state`` and ``param_groups`` (indices
        over the masters), with :meth:`mixprec_state_dict` under ``param_groups[0]["mixprec"]``,
        which ``torch.optim.Optimizer.load_state_dict`` keeps (:mod:`mixprec._core.resume`)."""
        inner = self.optimizer.state_dict()
        if self.updater is not None:
            inner = self.updater.export_states(inner)
        return pack_state_dict(inner, self.mixprec_state_dict())

    def fp32_state_dict(self, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        """The optimizer state a plain torch optimizer over the fp32 model loads: ``state_dict``
        (default: this optimizer's :meth:`state_dict`) with 8- and 4-bit states decoded to
        float32 and mixprec's own entry removed. With :func:`mixprec.fp32_state_dict`::

            plain_model.load_state_dict(mixprec.fp32_state_dict(model, opt))
            plain_opt.load_state_dict(opt.fp32_state_dict())
        """
        return fp32_optimizer_state_dict(self.state_dict() if state_dict is None else state_dict)

    def mixprec_state_dict(self) -> dict[str, Any]:
        """mixprec's own state: the masters' exact values, every loss scaler, the skip counters
        and, with an update mode, its state (compensation, rounding step count)."""
        own: dict[str, Any] = {
            "masters": [m.detach().clone() for _, m in self._pairs],
            "master_positions": [  # where each master sits in parameter-group order
                i
                for i, q in enumerate(q for g in self.optimizer.param_groups for q in g["params"])
                if id(q) in self._master_ids
            ],
            "scalers": [s.scaler.state_dict() for s in self.slots],
            "skipped_steps": self.skipped_steps,
            "step_skipped": self.step_skipped,
            "state_steps": state_steps(self.optimizer.state),  # to tell a stale entry
        }
        if self.updater is not None:
            own["lean"] = self.updater.state_dict()
        return own

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, an older mixprec layout (``"mixprec"`` or
        ``optimizer``, ``masters``, ``scalers``, ... at the top), or a plain torch optimizer's
        state dict. The saved masters and compensation are taken as they are: loaded after
        ``initialize``, this is the checkpoint's state (the model's 16-bit weights follow the
        masters).

        A plain torch dict sets the inner optimizer's state and hyper-parameters only: the
        masters keep following the model (load the model's state dict for its weights) and the
        loss scalers and counters keep their state. The layout and the numbers of masters and
        scalers are checked before anything is written.
        """
        inner, own = split_state_dict(state_dict)
        own = drop_stale(inner, own)
        writes, report = [], []
        if own is not None:
            inner, own, writes, report = adapt(self, inner, own)  # another recipe's layout
            self._check_own(own)
            if self.updater is not None:
                self.updater.load_state_dict(own.get("lean"))
        self.optimizer.load_state_dict(inner)
        if self.updater is not None:
            self.updater.restore_state_dtypes(inner)
        for p, value in writes:
            p.copy_(value)
        if own is None:
            return
        announce(self, report)
        for (p, m), saved in zip(self._pairs, own["masters"]):
            m.copy_(saved)
            p.copy_(saved)
        for slot, sd in zip(self.slots, own["scalers"]):
            slot.scaler.load_state_dict(sd)
            slot.pending.clear()
        self.skipped_steps = int(own["skipped_steps"])
        self.step_skipped = bool(own.get("step_skipped", False))

    def saved_by_another_recipe(self, inner: dict[str, Any], own: dict[str, Any]) -> bool:
        """Whether mixprec's saved entry ``own`` (of optimizer state ``inner``) holds the
        weights or the update otherwise than this optimizer (:mod:`mixprec._core.recipe_change`)."""
        return bool(adapt(self, inner, own)[3])

    def _check_own(self, own: dict[str, Any]) -> None:
        missing = sorted({"masters", "scalers", "skipped_steps"} - set(own))
        if missing:
            raise KeyError(
                f"The checkpoint's {MIXPREC_KEY!r} entry misses {missing}: it was not "
                "written by MixedPrecisionOptimizer.state_dict."
            )
        if len(own["masters"]) != len(self._pairs):
            raise ValueError(
                f"The checkpoint has {len(own['masters'])} master weights, this optimizer "
                f"has {len(self._pairs)}: was it saved at another level or model?"
            )
        if len(own["scalers"]) != len(self.slots):
            raise ValueError(
                f"The checkpoint has {len(own['scalers'])} loss scalers, this "
                f"optimizer has {len(self.slots)} (num_losses)."
            )
        saved = own.get("lean")
        if self.updater is None and saved is not None:  # its compensation would be dropped
            raise ValueError(
                f"The checkpoint was saved with update={saved.get('update')!r}, this "
                "optimizer uses update=None; initialize with the same update mode to resume "
                f"(update={saved.get('update')!r})."
            )
