"""``mixprec.amp.GradScaler``: ``torch.amp.GradScaler`` with its traps fixed and mixprec's extras.

Design (``docs/design.md``, "A drop-in for torch.amp"):

* **A subclass of torch's scaler.** Its constructor, methods, stage rules and error messages,
  ``state_dict``, pickles and the private attributes trainers read (``_scale``,
  ``_per_optimizer_states``, ``_unscale_grads_``...) are torch's own, so code written for
  ``torch.amp.GradScaler`` runs unchanged (``tests/amp/conformance/`` checks it against torch's).
* **The scale rule.** By default torch's kernel (``torch._amp_update_scale_``: on the device, no
  host sync), so the scale follows torch's bit for bit. ``hysteresis``, ``min_scale`` or
  ``max_scale`` switch to :class:`mixprec._core.loss_scale.LossScaler`'s rule, kept on the host:
  ``update()``
  then reads the step's verdict once (the non-fused ``step()`` has read it already).
* **Skips are counted** on the device (``skipped_steps``, ``step_skipped``); reading them syncs.
* **Ranks agree.** With more than one rank, the verdict of each ``unscale_`` is all-reduced
  (MAX, one collective of one element, :class:`mixprec.distributed.FlagReducer`), so a
  gradient that is non-finite on one rank skips the step on all of them and the scales stay
  equal. DTensor gradients (FSDP2) are reduced by torch's own kernel already, so no extra
  collective runs for them.
* **Traps fixed.** A closure given to ``step()`` (positionally or not; torch's check saw only
  ``closure=``) is wrapped: every evaluation unscales the gradients it produced before the
  optimizer reads them, and a non-finite evaluation abandons the step (parameters restored).
  A disabled scaler's getters return the configured values (torch raised AttributeError). A
  scaler used with bfloat16 -- autocast regions or gradients -- warns once that it does
  nothing useful there.
"""

from __future__ import annotations

import inspect
import os
import struct
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from mixprec._core.loss_scale import LossScaler
from mixprec.amp import autocast_mode
from mixprec.amp.skip_report import parameter_names, skip_report

__all__ = ["GradScaler", "OptState"]

_FP32_MAX = float(torch.finfo(torch.float32).max)
_NO_FLOOR = 2.0**-149  # the smallest positive float32: torch's scale has no floor
_LOCAL = object()  # no cross-rank agreement
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_signatures: dict[Any, list[str]] = {}
# files whose frames a warning skips to reach the user's call: this package and torch.amp
_INTERNAL = tuple(
    os.path.dirname(f) + os.sep for f in (__file__, inspect.getfile(torch.amp.GradScaler))
)


class _NonFiniteEvaluation(Exception):
    """Abandons an optimizer step from inside its closure: the gradients were not finite."""


def _as_fp32(value: float) -> float:
    """``value`` rounded to float32, as torch keeps the scale."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _closure_slot(step: Callable, args: tuple, kwargs: dict) -> int | str | None:
    """Where a closure sits in ``step(*args, **kwargs)``: an index into ``args``, the keyword
    ``"closure"``, or None when the call passes none."""
    if kwargs.get("closure") is not None:
        return "closure"
    if not args:
        return None
    fn = getattr(step, "__func__", step)
    names = _signatures.get(fn)
    if names is None:
        try:
            params = inspect.signature(step).parameters.values()
        except (TypeError, ValueError):
            params = []
        names = _signatures[fn] = [p.name for p in params if p.kind in _POSITIONAL]
    for i, name in enumerate(names[: len(args)]):
        if name == "closure" and args[i] is not None:
            return i
    return None


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler(device="cuda", init_scale=2.**16, growth_factor=2.0,
    backoff_factor=0.5, growth_interval=2000, enabled=True)``, plus keyword-only extras.

    Everything torch documents holds: ``scale``, ``unscale_``, ``step(optimizer, *args,
    **kwargs)``, ``update(new_scale=None)``, ``get_scale``, the growth/backoff getters and
    setters, ``is_enabled``, ``state_dict`` / ``load_state_dict`` (torch's five keys; a torch
    scaler's state loads here and this one's loads there), the per-optimizer stage rules and
    their messages. A ``device="cuda"`` scaler on a machine without CUDA warns and disables
    itself, as torch's does.

    Args:
        hysteresis: back off only after this many consecutive non-finite steps (Megatron's
            rule; 1 is torch's). Any of ``hysteresis``, ``min_scale``, ``max_scale`` selects
            :class:`mixprec._core.loss_scale.LossScaler`'s rule, which reads the verdict on the
            host at
            ``update()``.
        min_scale: a floor for the scale (torch has none: the scale can fall to 0).
        max_scale: a ceiling for the scale (torch stops growth only at float32's overflow).
        process_group: the ranks that must skip together. ``"auto"`` (default): every rank of
            the default group when ``torch.distributed`` is initialized with more than one
            rank; a ``ProcessGroup``: that group; ``None``: each rank decides alone (torch's
            behaviour). Every rank must then call ``unscale_``/``step`` equally often, as data
            parallel training does; pass None under ``Join`` with uneven inputs. A pickled or
            copied scaler keeps ``"auto"`` in place of an explicit group.
        locate_nonfinite: ``True`` or the model: when a step is skipped, warn with a report
            of which gradients held inf/NaN (parameter names when the model is given); the
            text is also kept in ``last_skip_report``.

    Attributes:
        skipped_steps: steps skipped since construction (or the loaded checkpoint).
        step_skipped: whether the last ``update()`` saw a non-finite gradient (None before).

    Closures: ``scaler.step(optimizer, closure)`` works (LBFGS). The closure computes the loss,
    calls ``scaler.scale(loss).backward()`` and returns the loss itself; each evaluation's
    gradients are unscaled before the optimizer reads them. Rank agreement does not apply to
    closure steps (their number of evaluations may differ between ranks).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler("cpu", init_scale=2.0**10, hysteresis=2, min_scale=1.0)
        >>> with mixprec.amp.autocast("cpu", torch.float16):
        ...     loss = model(torch.randn(3, 4)).float().pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.step_skipped, scaler.skipped_steps
        (False, 0)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        process_group: Any = "auto",
        locate_nonfinite: bool | nn.Module = False,
    ) -> None:
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        if not self._enabled:  # torch sets these only when enabled: its getters then raised
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
        self._rule: LossScaler | None = None
        if hysteresis != 1 or min_scale is not None or max_scale is not None:
            rule = LossScaler(
                init_scale if self._enabled else 1.0,
                growth_factor=growth_factor if self._enabled else 2.0,
                backoff_factor=backoff_factor if self._enabled else 0.5,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                min_scale=_NO_FLOOR if min_scale is None else min_scale,
                max_scale=_FP32_MAX if max_scale is None else max_scale,
                enabled=self._enabled,
            )  # validates the extras even when disabled: one loop serves every precision
            self._rule = rule if self._enabled else None
        if not (process_group in ("auto", None) or isinstance(process_group, _group_type())):
            raise TypeError(
                f"process_group must be 'auto', None or a torch.distributed.ProcessGroup; "
                f"received {process_group!r}."
            )
        self._process_group = process_group
        model = locate_nonfinite if isinstance(locate_nonfinite, nn.Module) else None
        self._locate = model is not None or bool(locate_nonfinite)
        self._names = parameter_names(model) if model is not None else None
        self.last_skip_report: str | None = None
        self._skipped = 0  # host part of the skip count; _skipped_t holds what the device adds
        self._skipped_t: Tensor | None = None
        self._last: bool | Tensor | None = None
        self._bf16_warned = False
        kind = str(device).split(":")[0]  # regions entered from now on count
        self._bf16_seen = autocast_mode.REGIONS[(kind, torch.bfloat16)]
        self._fp16_seen = autocast_mode.REGIONS[(kind, torch.float16)]
        self._looked_at: set[int] = set()  # optimizers whose gradient dtypes were checked
        self._dtensor: dict[int, bool] = {}

    # -- the training loop ---------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        if self._enabled and not self._bf16_warned:
            self._check_bfloat16(outputs)
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        slot = _closure_slot(optimizer.step, args, kwargs)
        if slot is not None:
            return self._step_with_closure(optimizer, slot, args, kwargs)
        if "closure" in kwargs:  # closure=None: torch's key check would refuse it
            kwargs = {k: v for k, v in kwargs.items() if k != "closure"}
        retval = super().step(optimizer, *args, **kwargs)
        if self._locate and getattr(optimizer, "_step_supports_amp_scaling", False):
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            if sum(v.item() for v in found.values()):  # the fused kernel skipped on the device
                self._report(optimizer)
        return retval

    def update(self, new_scale: float | Tensor | None = None) -> None:
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        verdict = None  # 1.0 when some optimizer met inf/NaN (each flag is 0.0 or 1.0)
        if found_infs:
            verdict = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).amax()
        rule = self._rule
        if new_scale is not None or rule is None:
            super().update(new_scale)
            if verdict is not None:
                self._count(verdict)
            if rule is not None:
                rule.scale = float(scale.item())
            return
        if verdict is None:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = bool(verdict.item())  # the host rule's one read of the step's verdict
        self._count(found)
        rule.growth_factor, rule.backoff_factor = self._growth_factor, self._backoff_factor
        rule.growth_interval = self._growth_interval
        rule.update(found)
        rule.scale = _as_fp32(rule.scale)
        scale.fill_(rule.scale)
        tracker.fill_(rule.growth_tracker)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- what mixprec adds -----------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps whose gradients held inf/NaN (reading it syncs with the device)."""
        if self._skipped_t is not None:
            self._skipped += int(self._skipped_t.item())
            self._skipped_t = None
        return self._skipped

    @property
    def step_skipped(self) -> bool | None:
        """True when the last ``update()`` saw inf/NaN; None before the first (syncs)."""
        if not self._enabled:
            return False
        if isinstance(self._last, Tensor):
            self._last = bool(self._last.item() > 0)
        return self._last

    def _count(self, verdict: bool | Tensor) -> None:
        self._last = verdict
        if isinstance(verdict, bool):
            self._skipped += verdict
            return
        if self._skipped_t is None:  # float64: exact counts, one kernel per update
            self._skipped_t = torch.zeros((), dtype=torch.float64, device=verdict.device)
        self._skipped_t.add_(verdict)

    def _check_bfloat16(self, outputs: Any) -> None:
        device = str(self._device).split(":")[0]
        bf16 = autocast_mode.REGIONS[(device, torch.bfloat16)]
        fp16 = autocast_mode.REGIONS[(device, torch.float16)]
        new_bf16, new_fp16 = bf16 - self._bf16_seen, fp16 - self._fp16_seen
        self._bf16_seen, self._fp16_seen = bf16, fp16
        if new_bf16 and not new_fp16:
            self._warn_bfloat16(f"autocast regions on '{device}' run in bfloat16")
        elif isinstance(outputs, Tensor) and outputs.dtype == torch.bfloat16:
            self._warn_bfloat16("the loss it scales is bfloat16")

    def _warn_bfloat16(self, what: str) -> None:
        self._bf16_warned = True
        _warn(
            f"GradScaler is enabled but {what}. bfloat16 has float32's exponent range, so "
            "gradients do not underflow and loss scaling only multiplies and divides them. "
            "Drop the scaler (GradScaler(..., enabled=False)), or use dtype=torch.float16 if "
            "float16 was meant.",
            UserWarning,
        )

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, Tensor]:
        if not self._bf16_warned and id(optimizer) not in self._looked_at:
            self._looked_at.add(id(optimizer))
            if any(g.dtype == torch.bfloat16 for g in _grads(optimizer)):
                self._warn_bfloat16("the gradients it unscales are bfloat16")
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        super()._check_inf_per_device(optimizer)
        self._agree(optimizer)
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            self._report(optimizer)
            return None
        return optimizer.step(*args, **kwargs)

    def _report(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._locate:
            return
        self.last_skip_report = skip_report(
            optimizer, self.get_scale(), self._names, "mixprec.amp.GradScaler"
        )
        _warn(self.last_skip_report, RuntimeWarning)

    # -- ranks ---------------------------------------------------------------------------------
    def _group(self) -> Any:
        """The process group whose ranks must agree, or ``_LOCAL``."""
        pg = self._process_group
        if pg is None:
            return _LOCAL
        if not (dist.is_available() and dist.is_initialized()):
            if pg == "auto":
                return _LOCAL
            raise RuntimeError(
                "GradScaler(process_group=...) needs torch.distributed initialized: call "
                "torch.distributed.init_process_group first, or pass process_group=None."
            )
        if pg == "auto":
            return None if dist.get_world_size() > 1 else _LOCAL
        return pg

    def _agree(self, optimizer: torch.optim.Optimizer) -> None:
        """Make this optimizer's verdict the same on every rank: one MAX all-reduce."""
        group = self._group()
        if group is _LOCAL or self._has_dtensor_grads(optimizer):
            return  # DTensor gradients: torch's kernel reduced the flag over the mesh already
        from mixprec.distributed.verdicts import FlagReducer

        state = self._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        device = self._scale.device if self._scale is not None else torch.device(self._device)
        flags = [f.reshape(()).to(device) for f in found.values()]
        flag = torch.stack(flags).amax() if flags else torch.zeros((), device=device)
        (reduced,) = FlagReducer(group)([flag])  # every rank takes part, even one with no grads
        state["found_inf_per_device"] = {d: reduced.reshape(()).to(d) for d in found}

    def _has_dtensor_grads(self, optimizer: torch.optim.Optimizer) -> bool:
        key = id(optimizer)
        if key not in self._dtensor:
            grads = list(_grads(optimizer))
            if not grads:
                return False
            self._dtensor[key] = any(
                isinstance(getattr(g, "_local_tensor", None), Tensor) for g in grads
            )
        return self._dtensor[key]

    # -- closures ------------------------------------------------------------------------------
    def _step_with_closure(
        self, optimizer: torch.optim.Optimizer, slot: int | str, args: tuple, kwargs: dict
    ) -> Any:
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        closure = args[slot] if isinstance(slot, int) else kwargs[slot]
        found_all: dict[torch.device, Tensor] = {}
        snapshot: list[tuple[Tensor, Tensor]] = []

        def unscaled() -> Any:
            loss = closure()
            scale, _ = self._check_scale_growth_tracker("step")
            inv_scale = scale.double().reciprocal().float()
            zero = torch.zeros((), dtype=torch.float32, device=scale.device)
            found = self._unscale_grads_(optimizer, inv_scale, zero, False)
            for d, f in found.items():
                found_all[d] = f if d not in found_all else torch.maximum(found_all[d], f)
            if sum(f.item() for f in found.values()):
                raise _NonFiniteEvaluation
            if not snapshot:  # the optimizer has not moved the parameters yet
                snapshot.extend((p, p.detach().clone()) for p in _params(optimizer))
            return loss

        if isinstance(slot, int):
            args = (*args[:slot], unscaled, *args[slot + 1 :])
        else:
            kwargs = {**kwargs, slot: unscaled}
        try:
            retval = optimizer.step(*args, **kwargs)
        except _NonFiniteEvaluation:
            retval = None
            with torch.no_grad():
                for p, saved in snapshot:
                    p.copy_(saved)
            self._report(optimizer)
        state["found_inf_per_device"] = found_all
        state["stage"] = OptState.STEPPED
        return retval

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries; with ``hysteresis``/``min_scale``/``max_scale`` also
        ``"mixprec"``: the hysteresis tracker and the skip count (torch ignores the key)."""
        state = super().state_dict()
        if state and self._rule is not None:
            state["mixprec"] = {
                "hysteresis_tracker": self._rule.hysteresis_tracker,
                "skipped_steps": self.skipped_steps,
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        own = state_dict.get("mixprec", {})
        if "skipped_steps" in own:
            self._skipped, self._skipped_t = int(own["skipped_steps"]), None
        rule = self._rule
        if rule is not None:
            rule.scale = float(state_dict["scale"])
            rule.growth_tracker = int(state_dict["_growth_tracker"])
            rule.hysteresis_tracker = int(own.get("hysteresis_tracker", rule.hysteresis))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_skipped"], state["_skipped_t"] = self.skipped_steps, None
        state["_last"] = self.step_skipped if self._enabled else None
        state["_dtensor"], state["_looked_at"], state["_names"] = {}, set(), None
        if state["_process_group"] not in ("auto", None):
            state["_process_group"] = "auto"  # a process group does not pickle
        return state


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside mixprec.amp and torch.amp: the user's call."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _group_type() -> tuple[type, ...]:
    return (dist.ProcessGroup,) if dist.is_available() else ()


def _params(optimizer: torch.optim.Optimizer) -> Iterable[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _grads(optimizer: torch.optim.Optimizer) -> Iterable[Tensor]:
    return (p.grad for p in _params(optimizer) if p.grad is not None)
