"""From backward to step: gradients moved into the fp32 masters, unscaled, checked, settled.

Design (``docs/design.md``, "Master weights and the optimizer"): the gradient half of
:class:`~mixprec._core.optimizer.MixedPrecisionOptimizer`, as a mixin that reads the
optimizer's own fields. After each scaled backward the 16-bit gradients are widened into fp32
master gradients and unscaled and checked in one fused pass that leaves the verdict on the
device; ``step()`` reads every verdict with one host sync (:meth:`GradientChecks._settle`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec._core._warnings import MixprecNumericsWarning
from mixprec._core.loss_scale import LossScaler, unscale_and_check_

__all__ = ["SETTLE_HOOKS", "GradientChecks", "LossSlot", "read_flags"]

#: ``hook(optimizer)``, run by every step before it reads its verdicts. The distributed layer
#: adds one (a plain ``DDP(model)`` seen running the model: the ranks must skip together). A
#: registry rather than an import: the core imports nothing above it.
SETTLE_HOOKS: list[Callable[[Optimizer], None]] = []


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


def _flag(flags: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """This call's verdict flag on ``device`` (made on first use)."""
    flag = flags.get(device)
    if flag is None:
        flag = flags[device] = torch.zeros(1, device=device)
    return flag


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


class GradientChecks:
    """The gradient half of :class:`~mixprec._core.optimizer.MixedPrecisionOptimizer`.

    Uses the optimizer's fields below and its ``master_params()``, ``_own_params()`` and
    ``slot(loss_id)``.
    """

    slots: list[LossSlot]
    master_dtype: torch.dtype
    #: set by distributed training: reduces the verdict flags across ranks (one collective)
    reduce_flags: Callable[[list[Tensor]], list[Tensor]] | None
    _pairs: list[tuple[Tensor, Tensor]]  # (16-bit model parameter, fp32 master)
    _found: dict[torch.device, Tensor]  # verdicts of scaled backwards, per device
    #: verdicts of gradients checked outside a scaled backward: they skip the step and count
    #: against every loss scaler whose loss fed it
    _late: dict[torch.device, Tensor]
    #: set by the distributed layer's forward hook: the backward of the forward that ran last
    #: will not all-reduce (``DDP.no_sync()``), so its gradients stay in ``.grad``
    unsynced_backward: bool = False
    _deferred: int | None = None  # the loss id of scaled gradients left in .grad (no_sync)
    _touched: set[int]  # loss ids recorded since the last step
    _stash: dict[Tensor, Tensor]  # unscaled gradients set aside during a backward
    _grad_buffers: dict[int, Tensor]  # id(master) -> persistent fp32 gradient (CPU)
    _checked: dict[int, tuple[Any, int]]  # id(param) -> (weakref to grad, its version)

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
            MixprecNumericsWarning,
            stacklevel=5,  # the caller of step() (through torch.no_grad's wrapper)
        )

    def _unscale(self, scale: float) -> Tensor | None:
        """After a backward: unscale fresh grads into master grads; return the verdict flag."""
        flags: dict[torch.device, Tensor] = {}  # this call's, one per device
        targets = self._widened(scale, flags) if self._pairs else []
        fresh = {} if scale == 1.0 else _by_device([g for _, g in targets])
        for p in self._own_params():
            if p.grad is not None:
                fresh.setdefault(p.grad.device, []).append(p.grad)
                targets.append((p, p.grad))
        if targets:
            for device, grads in fresh.items():
                unscale_and_check_(grads, 1.0 / scale, _flag(flags, device))
            self._accumulate(targets)
        for device, flag in flags.items():
            _flag(self._found, device).add_(flag)
        if len(flags) <= 1:
            return next(iter(flags.values()), None)
        return torch.tensor([sum(read_flags(list(flags.values())))])  # one sync per device

    def _widened(self, scale: float, flags: dict[torch.device, Tensor]) -> list[tuple]:
        """The 16-bit model grads widened: ``(master, fp32 grad)`` targets. Without a scale the
        16-bit grads are checked where they are (half the bytes of an fp32 pass); with one,
        widening comes first (fp16 would underflow). A master gradient written since its
        check (clipping by hand, a hook) is checked as it is."""
        if scale == 1.0:
            low = [p.grad for p, _ in self._pairs if p.grad is not None]
            for device, grads in _by_device(low).items():
                unscale_and_check_(grads, 1.0, _flag(flags, device))
        targets = [(master, g) for g, master in self._widen()]
        changed = [m for _, m in self._pairs if self._unchecked(m)]
        for device, grads in _by_device([m.grad for m in changed]).items():
            unscale_and_check_(grads, 1.0, _flag(flags, device))
        for m in changed:
            self._checked[id(m)] = (weakref.ref(m.grad), _version(m.grad))
        return targets

    def _accumulate(self, targets: list[tuple[Tensor, Tensor]]) -> None:
        """Each fresh gradient into its target's ``.grad``, added to what is there (an
        accumulation, a stashed gradient), and recorded as checked."""
        stash, checked = self._stash, self._checked
        for target, g in targets:
            stashed = stash.pop(target, None) if stash else None
            grad = target.grad
            if grad is None or grad is g:
                if stashed is not None:
                    g.add_(stashed)
                if grad is None:
                    target.grad = g
                grad = g
            else:
                grad.add_(g)
            checked[id(target)] = (weakref.ref(grad), _version(grad))

    def _widen(self) -> list[tuple[Tensor, Tensor]]:
        """Move 16-bit model grads into fp32 tensors; return ``(fp32 grad, master)`` pairs: kept
        buffers on a CPU, one fresh flat buffer per device elsewhere (see :meth:`_flat`)."""
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
            self._flat(device, pairs, srcs, bufs, out)
        if bufs:
            torch._foreach_copy_(bufs, srcs)
        return out

    def _flat(self, device: torch.device, pairs: list, srcs: list, bufs: list, out: list) -> None:
        """Where the allocator caches freed memory (CUDA): views of one fresh flat buffer, freed
        by ``zero_grad``, so their 4 bytes per parameter are not held through the forward."""
        flat = torch.empty(
            sum(p.grad.numel() for p, _ in pairs), dtype=self.master_dtype, device=device
        )
        for (p, master), view in zip(pairs, flat.split([p.grad.numel() for p, _ in pairs])):
            srcs.append(p.grad)
            bufs.append(view.view(p.grad.shape))
            out.append((bufs[-1], master))
            p.grad = None

    @staticmethod
    def keep_grad_buffers(device: torch.device) -> bool:
        """Keep fp32 master-grad buffers between steps on ``device`` (see :meth:`_widen`)."""
        return device.type == "cpu"

    def record_backward(self, loss_id: int) -> Tensor | None:
        """After the backward of loss ``loss_id``: unscale and check; return this optimizer's
        verdict flag (None: the backward gave it no gradients)."""
        slot = self.slot(loss_id)
        self._deferred = None  # deferred micro-batches are in .grad: unscaled with this one
        flag = self._unscale(slot.scaler.scale)
        self._restore_stash()
        if flag is not None:
            slot.pending.append(flag)
            self._touched.add(loss_id)
        return flag

    def defer_backward(self, loss_id: int) -> None:
        """After a backward whose forward ran under ``DDP.no_sync()``: leave its scaled
        gradients in ``.grad`` for DDP to accumulate; the next synchronized backward of the same
        loss (or ``step()``) unscales and checks them with its own."""
        if self._deferred not in (None, loss_id):
            raise ValueError(
                f"Losses {self._deferred} and {loss_id} were both backpropagated under "
                "DDP.no_sync() in one step: their gradients accumulate in .grad unscaled, and "
                "each loss has its own scale. Accumulate one loss per step under no_sync, or "
                "sum the losses before backward."
            )
        self._deferred = loss_id

    def share_verdict(self, flag: Tensor) -> None:
        """Also skip the next step on ``flag``: another optimizer's verdict for the same loss."""
        _flag(self._found, flag.device).add_(flag)

    def _restore_stash(self) -> None:
        """Give back stashed grads of parameters the last backward did not reach."""
        for p, stashed in self._stash.items():
            p.grad = stashed if p.grad is None else p.grad.add_(stashed)
        self._stash.clear()

    def prepare_backward(self) -> None:
        """Called before ``backward``: take in raw grads, stash unscaled grads for accumulation."""
        if self._deferred is not None:
            return  # scaled grads of DDP.no_sync() micro-batches accumulate in .grad
        if self._has_raw_grads():
            self._check_late()  # grads of a plain loss.backward(): checked, not to be unscaled
        self._stash_grads()

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
        if self._deferred is not None:  # no synchronized backward closed the step
            self.record_backward(self._deferred)
        if self._has_raw_grads():
            self._check_late()  # plain loss.backward() (alone or after scaled ones), or a
            # gradient changed after its check: not unscaled
            if not self._touched:
                self._warn_unscaled()
        for hook in SETTLE_HOOKS:  # e.g. DDP(model) without wrap_ddp: same verdict everywhere
            hook(self)
        slots = [self.slots[i] for i in sorted(self._touched)]
        flags = list(self._found.values())
        if self.updater is not None:
            flags += self.updater.coded_flags()  # checked as they were coded
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
