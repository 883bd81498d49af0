"""The mixed-precision optimizer: fp32 master weights, unscaling, and skipped steps.

Design (``docs/design.md``, "Master weights and the optimizer"): it wraps any
``torch.optim.Optimizer``, puts an fp32 master of each 16-bit parameter into the inner
optimizer's ``param_groups``, steps them and copies them back into the 16-bit weights; without
masters the plan's update mode steps the 16-bit weights (:mod:`mixprec._core.update.modes`). A
non-finite gradient skips the step, leaving weights, masters and state bitwise unchanged. What
happens to gradients between a backward and ``step()`` is the mixin
:mod:`mixprec._core._gradients`; the checkpoint layout, :mod:`mixprec._core._optimizer_state`.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mixprec._core import _frames, regions
from mixprec._core._gradients import SETTLE_HOOKS, GradientChecks, LossSlot
from mixprec._core._optimizer_state import CheckpointState
from mixprec._core.clipping import TORCH_CLIPPING, clip_coded, refuse_released, register_masters
from mixprec._core.update.choice import UpdatePlan
from mixprec._core.update.modes import ModeUpdater
from mixprec._core.update.step import inner_step, make_updater

__all__ = ["SETTLE_HOOKS", "MixedPrecisionOptimizer", "StepGuard", "rounds_to", "scale_loss"]

_LOW = (torch.float16, torch.bfloat16)
_MASTERS = UpdatePlan()  # fp32 masters for the 16-bit weights, the optimizer's own step


def rounds_to(master: Tensor, value: Tensor) -> bool:
    """True when ``value`` is ``master`` in ``value``'s (narrower) dtype: it says nothing the
    more precise master does not, so the master is kept."""
    return value.dtype != master.dtype and torch.equal(master.to(value.dtype), value)


class MixedPrecisionOptimizer(GradientChecks, CheckpointState, Optimizer):
    """Wraps an optimizer with fp32 master weights, loss-scale handling and overflow skips.

    Built by :func:`mixprec.initialize`; use it like the optimizer it wraps. Extra API:
    ``backward(loss, loss_id=0)``, ``loss_scale``, ``step_skipped``, ``skipped_steps``,
    ``clip_grad_norm_(max_norm)``, ``grad_of(param)`` and ``master_params()``.

    Hold an LR scheduler on skipped steps with ``if not opt.step_skipped: sched.step()``.

    ``plan``: how the step writes the weights, an :class:`~mixprec._core.update.choice.UpdatePlan`
    in the Recipe's words (default: fp32 masters). Without masters, its ``update`` mode runs the
    memory-lean 16-bit step; see :mod:`mixprec._core.update.modes`. ``updater`` is the
    :class:`~mixprec._core.update.modes.ModeUpdater` (None without). ``recipe``: the
    :class:`mixprec.Recipe` it runs, every ``"auto"`` resolved (``print(opt.recipe)``).

    What happens to gradients between a backward and ``step()`` (widen, unscale, check, settle
    the verdicts) is :class:`~mixprec._core._gradients.GradientChecks`; ``state_dict`` and
    ``load_state_dict`` are :class:`~mixprec._core._optimizer_state.CheckpointState`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        slots: list[LossSlot],
        plan: UpdatePlan = _MASTERS,
        *,
        master_dtype: torch.dtype = torch.float32,
        fp32_values: dict[int, Tensor] | None = None,
        recipe: Any = None,
    ):
        if not (isinstance(optimizer, Optimizer) and isinstance(plan, UpdatePlan)):
            _refuse_arguments(optimizer, plan)
        self.optimizer = optimizer
        self.slots = slots
        self.plan = plan
        self.master_dtype = master_dtype
        self.step_skipped = False
        self.skipped_steps = 0
        self._model_to_master: dict[Tensor, Tensor] = {}
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (model param, master) for 16-bit params
        self._master_ids: set[int] = set()
        self._found: dict[torch.device, Tensor] = {}
        self._late: dict[torch.device, Tensor] = {}
        self._touched: set[int] = set()
        self._stash: dict[Tensor, Tensor] = {}
        self._grad_buffers: dict[int, Tensor] = {}
        self._checked: dict[int, tuple[Any, int]] = {}
        self.reduce_flags: Callable[[list[Tensor]], list[Tensor]] | None = None
        self._plain_ddp: Any = None  # a plain DDP seen running the model (distributed layer)
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        # the pre-cast fp32 values (by id) the masters start from, taken over from initialize
        self._given = fp32_values if fp32_values is not None else {}
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p) for p in group["params"]]
        del self._given
        regions.enable()  # mixprec's first use: its registrations with torch
        register_masters(self._pairs)  # torch's clip_grad_norm_ on model params reaches these
        self._versions = [p._version for p, _ in self._pairs]
        self.updater: ModeUpdater | None = make_updater(optimizer, plan)
        self._recipe = recipe

    @property
    def recipe(self) -> Any:
        """The :class:`mixprec.Recipe` this optimizer runs, every ``"auto"`` resolved: by the
        device and the optimizer at ``initialize``, ``gradients="auto"`` by the first step."""
        recipe, updater = self._recipe, self.updater
        if recipe is None or updater is None or recipe.gradients != "auto" or updater.deciding:
            return recipe
        return recipe.replace(gradients=updater.gradients)

    # -- delegation: schedulers and user code see the inner optimizer's groups and state -------
    param_groups = property(
        lambda self: self.optimizer.param_groups,
        lambda self, v: setattr(self.optimizer, "param_groups", v),
    )
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling: the gradients already checked are weak references to this process's live
        gradients, so a pickled copy starts with none checked. An update mode is refused: its
        rounding keys and released-gradient hooks belong to the parameters' identities, which
        pickling does not keep."""
        if self.updater is not None:
            raise TypeError(
                f"A MixedPrecisionOptimizer with an update mode (update={self.updater.update!r}) "
                "cannot be pickled whole: its per-parameter keys and hooks follow the "
                "parameters' identities. Copy it with copy.deepcopy((model, optimizer)), or "
                "save optimizer.state_dict() with model.state_dict() (mixprec.save_checkpoint)."
            )
        return {**self.__dict__, "_checked": {}}

    def __deepcopy__(self, memo: dict) -> MixedPrecisionOptimizer:
        """``copy.deepcopy``: every attribute copied (the checked gradients' weak references as
        they are), update modes included (see ``__getstate__`` for pickling)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_late", {})  # pickled before late verdicts were kept apart

    def __repr__(self) -> str:
        return (
            f"MixedPrecisionOptimizer({self.optimizer!r}, masters={len(self._pairs)}, "
            f"loss_scale={self.loss_scale})"
        )

    def _master_for(self, p: Tensor) -> Tensor:
        if not (self.plan.masters and p.dtype in _LOW):
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
        if self.updater is not None:
            self.updater.add_params(masters)

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

    # -- gradients (the rest: mixprec._core._gradients) -----------------------------------------
    def backward(self, loss: Tensor, loss_id: int = 0, **kwargs: Any) -> None:
        """``scale_loss(loss, self, loss_id)`` then ``backward()`` in one call."""
        _check_loss(loss)
        with _scaled(loss, [self], loss_id) as scaled:
            scaled.backward(**kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the *unscaled* master gradients to ``max_norm``; return their total norm."""
        params = self.master_params()
        coded = {} if self.updater is None else refuse_released(params, float(norm_type) == 2.0)
        if self._has_raw_grads():
            self._check_late()
        if coded:  # mixprec's clip of codes
            return clip_coded(params, coded, max_norm, norm_type, foreach=True)
        clip = TORCH_CLIPPING.get("clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
        grads = [p for p in params if p.grad is not None]  # torch's own: what the step reads
        return clip(grads, max_norm, norm_type=norm_type, foreach=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step the masters and copy them back, or skip the step on a non-finite gradient."""
        if closure is not None:
            raise NotImplementedError(_CLOSURE)
        self.__dict__.pop("_carry_pending", None)  # kept for a model load before this step
        self.step_skipped = self._settle()
        if self.step_skipped:
            return self._skip_step()
        for hook in self._optimizer_step_pre_hooks.values():
            hook(self, (), {})
        self._adopt_model_writes()
        self._in_step = True
        try:
            result = inner_step(self.optimizer, self.plan, self.updater)
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
        """A 16-bit weight written since the last step (its version counter moved) gives its
        value to the master, unless it is the master rounded (a resume)."""
        versions = self.__dict__.get("_versions")
        if versions is None or len(versions) != len(self._pairs):
            return
        for (p, master), seen in zip(self._pairs, versions):
            if p._version != seen and not rounds_to(master, p):
                master.copy_(p)

    def _skip_step(self) -> None:
        """A non-finite gradient: count the skip and drop this step's gradients."""
        self.skipped_steps += 1
        for p in self.master_params():
            p.grad = None
        for p, _ in self._pairs:
            p.grad = None
        self._stash.clear()
        if self.updater is not None:
            self.updater._end_released()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stash.clear()
        self._deferred = None
        self._found.clear()  # the verdicts were about the gradients dropped here
        self._late.clear()
        if self.updater is not None:
            self.updater._zero_released()
        params: Iterable[Tensor] = [*self.master_params(), *(p for p, _ in self._pairs)]
        for p in params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()
        if set_to_none and self.updater is not None:
            self.updater.gradients_freed()


_CLOSURE = (
    "MixedPrecisionOptimizer.step does not take a closure: compute the loss, call "
    "backward(loss), then step()."
)


def _refuse_arguments(optimizer: Any, plan: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "MixedPrecisionOptimizer wraps a torch.optim.Optimizer, received "
            f"{type(optimizer).__name__}."
        )
    raise TypeError(
        f"MixedPrecisionOptimizer's plan is an UpdatePlan, received {type(plan).__name__}."
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
        if wrapper is None or not wrapper.__dict__.get("_in_step", False):
            self._check_direct_step(type(optimizer).__name__, wrapper)

    def _check_direct_step(self, name: str, wrapper: MixedPrecisionOptimizer | None) -> None:
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
            if wrapper.updater is not None:
                parts.append(f"update={wrapper.updater.update!r} (fp32 arithmetic, then rounding)")
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

    On exit the gradients are unscaled into fp32 master gradients and checked for inf/NaN (no
    host sync); the next ``step()`` acts on the verdict. The block runs outside any open mixprec
    region (:func:`._frames.outside_regions`)."""
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
    with _scaled(loss, opts, loss_id) as scaled:
        yield scaled


@contextlib.contextmanager
def _scaled(loss: Tensor, opts: list[MixedPrecisionOptimizer], loss_id: int) -> Iterator[Tensor]:
    """:func:`scale_loss` for a checked loss and optimizers of one initialize call."""
    slot = opts[0].slot(loss_id)
    unsynced = all(o.unsynced_backward for o in opts)  # DDP.no_sync(): see _gradients
    for o in opts:
        o.prepare_backward()
    try:
        scaled = slot.scaler.scale_loss(loss)
        with _frames.outside_regions():
            yield scaled
    except BaseException:
        for o in opts:  # the backward failed: give back the grads stashed for accumulation
            o._restore_stash()
        raise
    if unsynced:
        for o in opts:
            o.defer_backward(loss_id)
        return
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
    if not (isinstance(loss, Tensor) and loss.requires_grad and loss.numel() == 1):
        _refuse_loss(loss)


def _refuse_loss(loss: Any) -> None:
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
