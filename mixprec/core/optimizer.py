"""The mixed-precision optimizer: fp32 master weights, unscaling, and skipped steps.

Design (``docs/design.md``, "Master weights and the optimizer"):

* It wraps any ``torch.optim.Optimizer``. Where a model parameter is 16-bit it keeps an fp32
  *master* copy, puts the master into the inner optimizer's ``param_groups`` (so the optimizer
  state is fp32 too), steps it, then writes the 16-bit copy back. fp32 parameters are their own
  masters.
* After each backward (``scale_loss`` exit, ``backward()``), 16-bit gradients are moved into fp32
  master gradients and everything is unscaled and checked for inf/NaN in one fused pass
  (``loss_scale.unscale_and_check_``) that leaves the verdict on the device. ``step()`` reads it
  with a single host sync, updates the loss scalers, and on a non-finite gradient skips the
  update entirely: parameters, masters and optimizer state stay bitwise unchanged, the
  gradients are dropped, ``step_skipped`` is True and ``skipped_steps`` counts up.
* Verdicts: a gradient checked outside a scaled backward (a plain ``loss.backward()``, one
  written after its check, on a model parameter or a master) skips the step and counts as an
  overflow for every loss scaler whose loss fed the step, so the optimizer's and the scaler's
  skip counts agree; an overflow inside one loss's backward moves that loss's scaler only.
* Gradient accumulation: gradients already unscaled are stashed before the next backward and
  added back after it, so each micro-batch is unscaled with the scale it was scaled with.
* One loss scaler per loss (``num_losses``), shared by every optimizer the loss touches; an
  overflow in one loss skips only the optimizers whose gradients it produced.
* Without masters, ``update`` ("nearest" | "kahan" | "stochastic") hands the step to
  :class:`mixprec.core.lean.LeanUpdate`: fp32 arithmetic on per-chunk temporaries, written back to
  the 16-bit weights with that rounding. ``update=None`` keeps the inner optimizer
  stepping the 16-bit parameters itself. A skipped step never reaches the updater, so
  compensation buffers, 16-bit state and the rounding generators stay untouched.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec.core import dispatch
from mixprec.core.clipping import register_masters
from mixprec.core.lean import LeanUpdate, StateDtype
from mixprec.core.loss_scale import LossScaler, unscale_and_check_
from mixprec.core.resume import (
    MIXPREC_KEY,
    drop_stale,
    pack_state_dict,
    split_state_dict,
    state_steps,
    take_state,
)

__all__ = [
    "MIXPREC_KEY",
    "SETTLE_HOOKS",
    "MixedPrecisionOptimizer",
    "scale_loss",
    "split_state_dict",
    "take_state",
]

#: ``hook(optimizer)``, run by every step before it reads its verdicts. The distributed layer
#: adds one (a plain ``DDP(model)`` seen running the model: the ranks must skip together). A
#: registry rather than an import: the core imports nothing above it.
SETTLE_HOOKS: list[Callable[[MixedPrecisionOptimizer], None]] = []

_LOW = (torch.float16, torch.bfloat16)


def read_flags(flags: list[Tensor]) -> list[float]:
    """Read 1-element verdict tensors to the host with one sync per device involved."""
    if not flags:
        return []
    if len({f.device for f in flags}) == 1:
        return torch.cat([f.reshape(1) for f in flags]).tolist()
    return [float(f) for f in flags]


def _by_device(tensors: list[Tensor]) -> dict[torch.device, list[Tensor]]:
    out: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _version(grad: Tensor) -> int:
    """A gradient's version counter; for a DTensor (FSDP2) that of its local shard, which is
    what in-place accumulation bumps (the DTensor's own counter stays 0)."""
    if type(grad) is Tensor:  # the common case, without the attribute lookup
        return grad._version
    local = getattr(grad, "_local_tensor", None)
    return (local if isinstance(local, Tensor) else grad)._version


class LossSlot:
    """A loss scaler plus the device-side verdicts recorded since its last update."""

    def __init__(self, scaler: LossScaler):
        self.scaler = scaler
        self.pending: list[Tensor] = []

    def flush(self, values: list[float] | None = None, skipped: bool = False) -> None:
        """Apply the pending verdicts (reading them from the device unless given); ``skipped``:
        the step is skipped for a reason found outside this loss's backward, which counts too."""
        if not self.pending:
            return
        if values is None:
            values = read_flags(self.pending)
        self.scaler.update(skipped or any(v != 0 for v in values))
        self.pending.clear()


def rounds_to(master: Tensor, value: Tensor) -> bool:
    """True when ``value`` is ``master`` in ``value``'s (narrower) dtype: it says nothing the
    more precise master does not, so the master is kept."""
    return value.dtype != master.dtype and torch.equal(master.to(value.dtype), value)


class MixedPrecisionOptimizer(Optimizer):
    """Wraps an optimizer with fp32 master weights, loss-scale handling and overflow skips.

    Built by :func:`mixprec.initialize`; use it like the optimizer it wraps. Extra API:
    ``backward(loss, loss_id=0)``, ``loss_scale``, ``step_skipped``, ``skipped_steps``,
    ``clip_grad_norm_(max_norm)``, ``grad_of(param)`` and ``master_params()``.

    Hold an LR scheduler on skipped steps with ``if not opt.step_skipped: sched.step()``.

    ``update``, ``state_dtype``, ``update_seed``: the memory-lean 16-bit step (no masters); see
    :mod:`mixprec.core.lean`. ``lean`` is the :class:`~mixprec.core.lean.LeanUpdate` (None without).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        slots: list[LossSlot],
        *,
        master_weights: bool = True,
        master_dtype: torch.dtype = torch.float32,
        update: str | None = None,
        state_dtype: StateDtype = None,
        update_seed: int = 0,
        fp32_values: dict[int, Tensor] | None = None,
    ):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "MixedPrecisionOptimizer wraps a torch.optim.Optimizer, received "
                f"{type(optimizer).__name__}."
            )
        if update is not None and master_weights:
            raise ValueError(
                f"update={update!r} replaces fp32 master weights: it needs "
                "master_weights=False (the O3 default)."
            )
        if update is None and (state_dtype is not None or update_seed != 0):
            raise ValueError(
                "state_dtype and update_seed apply to an update mode; pass "
                "update='nearest', 'kahan' or 'stochastic' as well."
            )
        self.optimizer = optimizer
        self.slots = slots
        self.master_weights = master_weights
        self.master_dtype = master_dtype
        self.step_skipped = False
        self.skipped_steps = 0
        self._model_to_master: dict[Tensor, Tensor] = {}
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (model param, master) for 16-bit params
        self._master_ids: set[int] = set()
        self._found: dict[torch.device, Tensor] = {}
        # verdicts of gradients checked outside a scaled backward (a plain loss.backward(), a
        # gradient written after it): they skip the step and count against every loss scaler
        # whose loss fed this step, so the scaler's and the optimizer's counts agree
        self._late: dict[torch.device, Tensor] = {}
        self._touched: set[int] = set()  # loss ids recorded since the last step
        self._stash: dict[Tensor, Tensor] = {}
        self._grad_buffers: dict[int, Tensor] = {}  # id(master) -> persistent fp32 grad
        # fp32 grads already checked: id(param) -> (weakref to grad, grad._version). A grad that
        # is new or was accumulated into since (a plain backward) is checked again.
        self._checked: dict[int, tuple[Any, int]] = {}
        # Distributed training sets this to reduce the verdict flags across ranks (in one
        # collective) so every rank skips the same steps; it returns the reduced flags.
        self.reduce_flags: Callable[[list[Tensor]], list[Tensor]] | None = None
        # A plain DistributedDataParallel seen running the model (weakref; set by the
        # distributed layer's forward hook): its settle hook makes the next verdicts global.
        self._plain_ddp: Any = None
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        # the values parameters held before they were cast to 16 bits (by id): the masters start
        # from them, not from the rounded weights (taken over, not copied: see initialize)
        self._given = fp32_values if fp32_values is not None else {}
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p) for p in group["params"]]
        del self._given
        dispatch.enable()  # mixprec's first use: its registrations with torch
        register_masters(self._pairs)  # torch's clip_grad_norm_ on model params reaches these
        self._versions = [p._version for p, _ in self._pairs]
        self.lean: LeanUpdate | None = None
        if update is not None:
            self.lean = LeanUpdate(
                optimizer, update, state_dtype=state_dtype or "auto", seed=update_seed
            )

    # -- delegation: schedulers and user code see the inner optimizer's groups and state -------
    param_groups = property(
        lambda self: self.optimizer.param_groups,
        lambda self, v: setattr(self.optimizer, "param_groups", v),
    )
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_late", {})  # pickled before late verdicts were kept apart

    def __repr__(self) -> str:
        return (
            f"MixedPrecisionOptimizer({self.optimizer!r}, masters={len(self._pairs)}, "
            f"loss_scale={self.loss_scale})"
        )

    def _master_for(self, p: Tensor) -> Tensor:
        if not (self.master_weights and p.dtype in _LOW):
            return p
        master = self._model_to_master.get(p)
        if master is None:
            given = self.__dict__.get("_given", {}).pop(id(p), None)
            source = given if given is not None and given.shape == p.shape else p.detach()
            master = source.detach().to(self.master_dtype).requires_grad_(p.requires_grad)
            self._model_to_master[p] = master
            self._pairs.append((p, master))
            self._master_ids.add(id(master))
        return master

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        masters = [self._master_for(p) for p in params]
        self.optimizer.add_param_group({**param_group, "params": masters})
        if self.lean is not None:
            self.lean.add_params(masters)

    def master_params(self) -> list[Tensor]:
        """The tensors the inner optimizer steps (fp32 masters or fp32 model parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _own_params(self) -> list[Tensor]:
        """Parameters the inner optimizer steps directly: fp32 ones, no master behind them."""
        return [p for p in self.master_params() if id(p) not in self._master_ids]

    def grad_of(self, param: Tensor) -> Tensor | None:
        """The unscaled gradient the next ``step()`` uses for model parameter ``param``: its fp32
        master's at O2 (where ``param.grad`` is None after ``backward``: the 16-bit gradient was
        moved into the master), ``param.grad`` otherwise. Read it after ``opt.backward(loss)``,
        e.g. for per-layer gradient norms::

            for name, p in model.named_parameters():
                g = opt.grad_of(p)
                if g is not None:
                    print(name, g.norm().item())
        """
        if self._has_raw_grads():
            self._check_late()  # a plain backward: checked, and moved to the masters
        master = self._model_to_master.get(param)
        return (master if master is not None else param).grad

    def model_params(self) -> list[Tensor]:
        """The model's own parameters managed by this optimizer."""
        back = {id(m): p for p, m in self._pairs}
        return [back.get(id(m), m) for m in self.master_params()]

    @property
    def loss_scale(self) -> float:
        """The current scale of loss 0."""
        return self.slot(0).scaler.scale

    def slot(self, loss_id: int) -> LossSlot:
        if not 0 <= loss_id < len(self.slots):
            raise ValueError(
                f"loss_id={loss_id} is out of range: this optimizer was initialized "
                f"with num_losses={len(self.slots)}; pass num_losses to initialize."
            )
        return self.slots[loss_id]

    # -- gradients ------------------------------------------------------------------------------
    def _found_for(self, device: torch.device) -> Tensor:
        flag = self._found.get(device)
        if flag is None:
            flag = self._found[device] = torch.zeros(1, device=device)
        return flag

    def _stash_grads(self) -> None:
        """Before a backward: move already-unscaled grads of fp32 parameters out of the way."""
        for p in self._own_params():
            if p.grad is not None and p not in self._stash:
                self._stash[p] = p.grad
                p.grad = None

    def _check_late(self) -> None:
        """Check gradients that have not been through a check yet (not unscaled: they did not
        come from a scaled backward)."""
        flag = self._unscale(1.0)
        if flag is not None:
            late = self._late.get(flag.device)
            self._late[flag.device] = flag if late is None else late.add_(flag)

    def _warn_unscaled(self) -> None:
        """Gradients reached this step from no scaled backward while a loss scale is in force:
        ``loss.backward()`` where ``opt.backward(loss)`` was meant (once per optimizer)."""
        scaler = self.slots[0].scaler if self.slots else None
        if scaler is None or scaler.scale == 1.0 or self.__dict__.get("_warned_unscaled"):
            return
        self._warned_unscaled = True
        warnings.warn(
            f"The gradients of this step came from a backward without loss scaling, while "
            f"the loss scale is {scaler.scale:g}: 16-bit gradients of a small loss underflow "
            "to zero unscaled. Call opt.backward(loss) (or `with mixprec.scale_loss(loss, "
            "opt) as scaled: scaled.backward()`) instead of loss.backward().",
            UserWarning,
            stacklevel=5,  # the caller of step() (through torch.no_grad's wrapper)
        )

    def _unscale(self, scale: float) -> Tensor | None:
        """After a backward: unscale fresh grads into master grads; return the verdict flag."""
        fresh: dict[torch.device, list[Tensor]] = {}
        targets: list[tuple[Tensor, Tensor]] = []
        call_flags: dict[torch.device, Tensor] = {}

        def flag_for(device: torch.device) -> Tensor:
            if device not in call_flags:
                call_flags[device] = torch.zeros(1, device=device)
            return call_flags[device]

        def flags_of(call_flags: dict[torch.device, Tensor]) -> Tensor | None:
            for device, flag in call_flags.items():
                self._found_for(device).add_(flag)
            flags = list(call_flags.values())
            if len(flags) <= 1:
                return flags[0] if flags else None
            return torch.tensor([sum(read_flags(flags))])  # several devices: one sync each

        if scale == 1.0:
            # Nothing to unscale: check the 16-bit grads where they are (half the bytes of an
            # fp32 pass), then widen. With a scale, widening comes first (fp16 would underflow).
            by_device: dict[torch.device, list[Tensor]] = {}
            for p, _ in self._pairs:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
            for device, grads in by_device.items():
                unscale_and_check_(grads, 1.0, flag_for(device))
        widened = self._widen()
        for g, master in widened:
            if scale != 1.0:
                fresh.setdefault(g.device, []).append(g)
            targets.append((master, g))
        for p in self._own_params():
            if p.grad is not None:
                fresh.setdefault(p.grad.device, []).append(p.grad)
                targets.append((p, p.grad))
        # a master gradient written since its check (clipping by hand, a hook): checked as is
        changed = [m for _, m in self._pairs if self._unchecked(m)]
        for device, grads in _by_device([m.grad for m in changed]).items():
            unscale_and_check_(grads, 1.0, flag_for(device))
        for m in changed:
            self._checked[id(m)] = (weakref.ref(m.grad), _version(m.grad))
        if not targets:
            return flags_of(call_flags)
        for device, grads in fresh.items():
            unscale_and_check_(grads, 1.0 / scale, flag_for(device))
        for target, g in targets:
            stashed = self._stash.pop(target, None)
            if target.grad is None or target.grad is g:
                target.grad = g if stashed is None else g.add_(stashed)
            else:
                target.grad.add_(g)
            self._checked[id(target)] = (weakref.ref(target.grad), _version(target.grad))
        return flags_of(call_flags)

    def _widen(self) -> list[tuple[Tensor, Tensor]]:
        """Move 16-bit model grads into fp32 tensors; return ``(fp32 grad, master)`` pairs.

        On a CPU a master whose grad is empty gets its persistent buffer: allocating fresh fp32
        grads every step costs page faults that took ~3x longer than the copy itself
        (benchmarks/NOTES.md), at 4 bytes per 16-bit parameter kept between steps -- also
        through the forward, where activations peak. Where the allocator caches freed memory
        (CUDA), a fresh flat buffer per device costs one allocation and no page faults, and is
        freed by ``zero_grad(set_to_none=True)``: those 4 bytes per parameter are not held while
        the activations are.
        """
        out: list[tuple[Tensor, Tensor]] = []
        srcs: list[Tensor] = []
        bufs: list[Tensor] = []
        fresh: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        for p, master in self._pairs:
            if p.grad is None:
                continue
            if master.grad is None and p.grad.layout == torch.strided:
                if not self.keep_grad_buffers(p.grad.device):
                    fresh.setdefault(p.grad.device, []).append((p, master))
                    continue
                buf = self._grad_buffers.get(id(master))
                if buf is None or buf.shape != p.grad.shape or buf.device != p.grad.device:
                    buf = torch.empty(p.grad.shape, dtype=self.master_dtype, device=p.grad.device)
                    self._grad_buffers[id(master)] = buf
                srcs.append(p.grad)
                bufs.append(buf)
                out.append((buf, master))
            else:
                out.append((p.grad.to(self.master_dtype), master))
            p.grad = None
        for device, pairs in fresh.items():
            flat = torch.empty(
                sum(p.grad.numel() for p, _ in pairs), dtype=self.master_dtype, device=device
            )
            views = flat.split([p.grad.numel() for p, _ in pairs])
            for (p, master), view in zip(pairs, views):
                srcs.append(p.grad)
                bufs.append(view.view(p.grad.shape))
                out.append((bufs[-1], master))
                p.grad = None
        if bufs:
            torch._foreach_copy_(bufs, srcs)
        return out

    @staticmethod
    def keep_grad_buffers(device: torch.device) -> bool:
        """Keep fp32 master-grad buffers between steps on ``device`` (see :meth:`_widen`)."""
        return device.type == "cpu"

    def record_backward(self, loss_id: int) -> Tensor | None:
        """Called after ``backward`` of a loss scaled by ``loss_id``'s scaler.

        Returns this optimizer's verdict flag for the backward (None: it produced no gradients).
        """
        slot = self.slot(loss_id)
        flag = self._unscale(slot.scaler.scale)
        self._restore_stash()
        if flag is not None:
            slot.pending.append(flag)
            self._touched.add(loss_id)
        return flag

    def share_verdict(self, flag: Tensor) -> None:
        """Also skip the next step on ``flag``: another optimizer's verdict for the same loss."""
        self._found_for(flag.device).add_(flag)

    def _restore_stash(self) -> None:
        """Give back stashed grads of parameters the last backward did not reach."""
        for p, stashed in self._stash.items():
            p.grad = stashed if p.grad is None else p.grad.add_(stashed)
        self._stash.clear()

    def prepare_backward(self) -> None:
        """Called before ``backward``: take in raw grads, stash unscaled grads for accumulation."""
        if self._has_raw_grads():
            self._check_late()  # grads of a plain loss.backward(): checked, not to be unscaled
        self._stash_grads()

    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs: Any) -> None:
        """``scale_loss(loss, self, loss_id)`` then ``backward()`` in one call."""
        with scale_loss(loss, self, loss_id=loss_id) as scaled:
            scaled.backward(**kwargs)

    def holds_its_gradients(self) -> bool:
        """True while a gradient this optimizer unscaled and checked (in ``backward`` or
        ``scale_loss``) waits for its ``step()``."""
        for p in self.master_params():
            seen = self._checked.get(id(p))
            if p.grad is not None and seen is not None and seen[0]() is p.grad:
                return True
        return False

    def _unchecked(self, p: Tensor) -> bool:
        if p.grad is None:
            return False
        seen = self._checked.get(id(p))
        return seen is None or seen[0]() is not p.grad or seen[1] != _version(p.grad)

    def _has_raw_grads(self) -> bool:
        """True when some gradient has not been through the finite check yet."""
        if any(p.grad is not None for p, _ in self._pairs):
            return True
        return any(self._unchecked(p) for p in self.master_params())

    def _settle(self) -> bool:
        """Process raw grads, read every verdict with one host sync, update the scalers."""
        if self._has_raw_grads():
            self._check_late()  # plain loss.backward() (alone or after scaled ones), or a
            # gradient changed after its check: not unscaled
            if not self._touched:
                self._warn_unscaled()
        for hook in SETTLE_HOOKS:  # e.g. DDP(model) without wrap_ddp: same verdict everywhere
            hook(self)
        slots = [self.slots[i] for i in sorted(self._touched)]
        flags = list(self._found.values())
        late = list(self._late.values())
        if self.reduce_flags is not None:  # the same number of flags on every rank
            late = [self._late.get(d, torch.zeros_like(f)) for d, f in self._found.items()]
        all_flags = flags + late + [p for s in slots for p in s.pending]
        if self.reduce_flags is not None and all_flags:
            all_flags = self.reduce_flags(all_flags)
        values = read_flags(all_flags)
        found = any(v != 0 for v in values[: len(flags)])
        found_late = any(v != 0 for v in values[len(flags) : len(flags) + len(late)])
        offset = len(flags) + len(late)
        for s in slots:
            n = len(s.pending)
            s.flush(values[offset : offset + n], skipped=found_late)
            offset += n
        self._found.clear()
        self._late.clear()
        self._touched.clear()
        return found

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the *unscaled* master gradients to ``max_norm``; return their total norm."""
        if self._has_raw_grads():
            self._check_late()
        grads = [p for p in self.master_params() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type, foreach=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step the masters and copy them back, or skip the step on a non-finite gradient."""
        if closure is not None:
            raise NotImplementedError(
                "MixedPrecisionOptimizer.step does not take a closure: "
                "compute the loss, call backward(loss), then step()."
            )
        found = self._settle()
        self.step_skipped = found
        if found:
            self.skipped_steps += 1
            self._drop_grads()
            return None
        for hook in self._optimizer_step_pre_hooks.values():
            hook(self, (), {})
        self._adopt_model_writes()
        self._in_step = True
        try:
            result = self.optimizer.step() if self.lean is None else self.lean.step()
        finally:
            self._in_step = False
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])
            self._versions = [p._version for p, _ in self._pairs]
        for hook in self._optimizer_step_post_hooks.values():
            hook(self, (), {})
        for _, master in self._pairs:  # used up: a loop that only zeroes the model's grads
            master.grad = None  # must not add them into the next step (as in Apex)
        return result

    def _adopt_model_writes(self) -> None:
        """A 16-bit weight written since the last step (``with torch.no_grad(): w.fill_(...)``,
        a load into a submodule) gives its value to the master, which the step would otherwise
        copy back over it. Only weights whose version counter moved are compared; a weight that
        is the master rounded (e.g. a resume) leaves the more precise master alone."""
        versions = self.__dict__.get("_versions")
        if versions is None or len(versions) != len(self._pairs):
            return
        for (p, master), seen in zip(self._pairs, versions):
            if p._version != seen and not rounds_to(master, p):
                master.copy_(p)

    def _drop_grads(self) -> None:
        for p in self.master_params():
            p.grad = None
        for p, _ in self._pairs:
            p.grad = None
        self._stash.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stash.clear()
        self._found.clear()  # the verdicts were about the gradients dropped here
        self._late.clear()
        params: Iterable[Tensor] = [*self.master_params(), *(p for p, _ in self._pairs)]
        for p in params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout, so the torch optimizer this wraps (or a plain one over the fp32
        model) loads it as it is: the inner optimizer's ``state`` and ``param_groups`` (indices
        over the masters), with :meth:`mixprec_state_dict` under ``param_groups[0]["mixprec"]``,
        which ``torch.optim.Optimizer.load_state_dict`` keeps (:mod:`mixprec.core.resume`)."""
        return pack_state_dict(self.optimizer.state_dict(), self.mixprec_state_dict())

    def mixprec_state_dict(self) -> dict[str, Any]:
        """mixprec's own state: the masters' exact values, every loss scaler, the skip counters
        and, with an update mode, its state (compensation, generators)."""
        own: dict[str, Any] = {
            "masters": [m.detach().clone() for _, m in self._pairs],
            "scalers": [s.scaler.state_dict() for s in self.slots],
            "skipped_steps": self.skipped_steps,
            "step_skipped": self.step_skipped,
            "state_steps": state_steps(self.optimizer.state),  # to tell a stale entry
        }
        if self.lean is not None:
            own["lean"] = self.lean.state_dict()
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
        if own is not None:
            self._check_own(own)
            if self.lean is not None:
                self.lean.load_state_dict(own.get("lean"))
        self.optimizer.load_state_dict(inner)
        if self.lean is not None:
            self.lean.restore_state_dtypes(inner)
        if own is None:
            return
        for (p, m), saved in zip(self._pairs, own["masters"]):
            m.copy_(saved)
            p.copy_(saved)
        for slot, sd in zip(self.slots, own["scalers"]):
            slot.scaler.load_state_dict(sd)
            slot.pending.clear()
        self.skipped_steps = int(own["skipped_steps"])
        self.step_skipped = bool(own.get("step_skipped", False))

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
        if self.lean is None and saved is not None:  # its compensation would be dropped
            raise ValueError(
                f"The checkpoint was saved with update={saved.get('update')!r}, this "
                "optimizer uses update=None; initialize with the same update mode to resume "
                f"(update={saved.get('update')!r})."
            )


class StepGuard:
    """A step pre-hook on the optimizer :func:`mixprec.initialize` wrapped: a direct step of it
    is refused where it would silently do the wrong thing.

    * Stepped after a plain backward at O2 (``initialize(model, opt)`` without ``model, opt =``,
      then ``loss.backward(); opt.step()``), it would step masters that have no gradients while
      the 16-bit model holds them -- training nothing.
    * Stepped after the returned optimizer's ``backward`` (``opt.backward(loss)`` then
      ``original.step()``), it would use gradients only the returned optimizer may consume: at O2
      the masters move and the 16-bit weights never do (nothing copies them back), and at every
      level the inf/NaN skip, the loss scaler's update and an update mode's compensated step are
      bypassed.

    Other direct steps pass (``torch.distributed.checkpoint`` steps it once with fresh zero
    gradients to create the state; a plain ``loss.backward()`` at O1 trains as without mixprec)."""

    def __init__(self, wrapper: MixedPrecisionOptimizer, level: str) -> None:
        self.wrapper = weakref.ref(wrapper)
        self.pairs = wrapper._pairs  # (16-bit model parameter, master); alive without wrapper
        self.level = level

    def __getstate__(self) -> dict[str, Any]:
        return {"level": self.level}  # a pickled copy guards nothing

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, wrapper=None, pairs=[])

    def __call__(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        wrapper = self.wrapper() if self.wrapper is not None else None
        if wrapper is not None and wrapper.__dict__.get("_in_step", False):
            return
        name = type(optimizer).__name__
        if any(p.grad is not None and m.grad is None for p, m in self.pairs):
            raise RuntimeError(
                f"This {name} was wrapped by mixprec.initialize (level "
                f"{self.level}): its parameters are now fp32 master copies that only the "
                "returned optimizer fills with gradients, so this step would train nothing. "
                "Use the optimizer initialize returned -- `model, opt = "
                "mixprec.initialize(model, opt, ...)`, then `opt.backward(loss)` and "
                "`opt.step()`."
            )
        if wrapper is not None and wrapper.holds_its_gradients():
            parts = ["the inf/NaN check that skips a step", "the loss scaler's update"]
            if wrapper.lean is not None:
                parts.append(f"update={wrapper.lean.update!r} (fp32 arithmetic, then rounding)")
            skipped = ", ".join(parts[:-1]) + " and " + parts[-1]
            what = (
                "would move its fp32 masters and not the model's 16-bit weights (only the "
                f"returned optimizer copies them back), and would skip {skipped}"
                if self.pairs
                else f"would skip {skipped}"
            )
            raise RuntimeError(
                f"This {name} was wrapped by mixprec.initialize (level {self.level}) and holds "
                f"the gradients of the returned optimizer's backward: stepping it directly "
                f"{what}. Step the optimizer initialize returned: `model, opt = "
                "mixprec.initialize(model, opt, ...)`, then `opt.backward(loss)` and "
                "`opt.step()`."
            )


@contextlib.contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: MixedPrecisionOptimizer | Sequence[MixedPrecisionOptimizer],
    loss_id: int = 0,
) -> Iterator[Tensor]:
    """Yield ``loss`` times the current scale of loss ``loss_id``; call ``.backward()`` on it.

    On exit the gradients of every given optimizer are unscaled into fp32 master gradients and
    checked for inf/NaN (one fused pass, no host sync); the next ``step()`` acts on the verdict.
    The block runs outside any mixprec region left open on this thread (e.g. by Apex's O1 shim):
    each backward op runs in the dtypes of its own forward (:func:`dispatch.outside_regions`).
    """
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opts or not all(isinstance(o, MixedPrecisionOptimizer) for o in opts):
        raise TypeError(
            "scale_loss expects the optimizer(s) returned by mixprec.initialize, "
            f"received {[type(o).__name__ for o in opts]}."
        )
    _check_loss(loss)
    if any(o.slots is not opts[0].slots for o in opts[1:]):
        raise ValueError(
            "scale_loss got optimizers from different initialize calls, which have "
            "different loss scalers; initialize every model and optimizer a loss "
            "touches in one call (lists of models and optimizers)."
        )
    slot = opts[0].slot(loss_id)
    for o in opts:
        o.prepare_backward()
    try:
        scaled = slot.scaler.scale_loss(loss)
        with dispatch.outside_regions():
            yield scaled
    except BaseException:
        for o in opts:  # the backward failed: give back the grads stashed for accumulation
            o._restore_stash()
        raise
    flags = [o.record_backward(loss_id) for o in opts]
    # One loss, one verdict: a non-finite gradient anywhere in this loss's gradients skips every
    # optimizer it produced gradients for (Apex semantics), not only the one holding it.
    for o, own in zip(opts, flags):
        if own is not None:
            for f in flags:
                if f is not None and f is not own:
                    o.share_verdict(f)


def _check_loss(loss: Any) -> None:
    """A clear error for a loss backward cannot take (instead of autograd's)."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"scale_loss expects a loss tensor, received {type(loss).__name__}.")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise TypeError(
            f"The loss is a {loss.dtype} tensor: gradients need a floating loss. "
            "Compute it from the model's outputs in floating point (e.g. "
            "F.cross_entropy(logits, target))."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"The loss must be a single number, received shape "
            f"{tuple(loss.shape)}: reduce it first (loss.mean() or loss.sum())."
        )
    if not loss.requires_grad:
        raise ValueError(
            "The loss does not require grad, so backward has nothing to "
            "differentiate: it was computed under torch.no_grad()/inference_mode(), "
            "from detached tensors, or from a model whose parameters all have "
            "requires_grad=False."
        )
