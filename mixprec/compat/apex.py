"""Apex drop-in: ``from mixprec.compat.apex import amp`` runs old ``apex.amp`` code on mixprec.

Design (``docs/design.md``, "Compatibility layers"): the ``amp`` namespace keeps Apex's signatures,
defaults and return shapes, and translates each call to mixprec -- ``amp.initialize`` to
:func:`mixprec.initialize`, ``amp.scale_loss`` to :func:`mixprec.scale_loss`, the
``register_*_function`` calls to the cast table. Opt-level properties are resolved here with
Apex's override rules (same errors for the same misuse), then mapped onto mixprec's levels. The
16-bit dtype defaults to float16 as in Apex; when mixprec knows bfloat16 is the better choice on
the device, ``initialize`` says so (``verbosity >= 1``) and ``dtype=torch.bfloat16`` switches.

Where Apex has a known flaw and fixing it cannot break a caller, mixprec's behaviour wins:

* O2 checkpoints keep the fp32 masters: the returned optimizer's ``state_dict`` (torch's layout,
  which the plain torch optimizer loads, with mixprec's state beside it) carries them, and
  ``model.state_dict()`` returns the masters' exact fp32 values (Apex returns fp32 casts of the
  fp16 weights, so a resume loses precision, apex#180/#480). A plain torch optimizer state dict
  (an old Apex checkpoint) still loads; the masters then keep the model's loaded values.
* Apex's restore order -- fresh model and optimizer, ``load_state_dict`` into them, then
  ``initialize`` -- resumes exactly: existing optimizer state is re-keyed onto the masters (as
  Apex does), and the masters start from the model's fp32 values, not from their 16-bit casts.
* Every level, static scaling included, checks gradients and skips a non-finite step (Apex's
  static scaling never checks).
* The numerically risky ops (softmax, norms, losses, ...) run in fp32 at O2/O3 too.
  ``binary_cross_entropy`` is cast to fp32 instead of banned. As in Apex, O1 outputs keep the
  dtype of the op that made them (``cast_model_outputs`` casts them) and O2/O3 outputs are fp32.
* ``initialize`` may be called again for new models (Apex: once per process); state is per call,
  ``amp.state_dict`` reports the latest call's scalers. Registrations work before or after it.
* Dynamic scaling has a floor (``min_loss_scale``, default 1.0) instead of none.
* ``delay_unscale`` is accepted and unnecessary: every backward is unscaled with its own scale.
* ``keep_batchnorm_fp32`` keeps every normalization layer fp32 (LayerNorm, GroupNorm too).
* Optimizer wrappers such as ``LARC(SGD(...))`` are accepted as in Apex
  (:mod:`mixprec._core.optimizer_view`); ``install()`` also provides ``apex.parallel.LARC``
  (:mod:`mixprec.compat.larc`).
* ``amp.init()``, Apex's older handle API, runs on a mixprec region
  (:mod:`mixprec.compat.amp_handle`). ``_amp_state`` exposes what Apex's tests and tools read:
  ``loss_scalers[i].loss_scale()`` (and ``_loss_scale`` to set it), ``opt_properties``,
  ``handle``. A model already cast to 16 bits is taken (Apex refuses it): at O1 its
  parameters are upcast to fp32 with a warning (:func:`mixprec.initialize`'s rule), unless
  ``_amp_state.allow_incoming_model_not_fp32`` is set, which keeps them as given, as in Apex.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import mixprec
from mixprec._core import engine
from mixprec._core._gradients import LossSlot
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._core.optimizer_view import as_torch_optimizer
from mixprec._core.resume import take_state
from mixprec._core.storage import ACCEPT_16BIT_ATTR
from mixprec._core.update.choice import UpdatePlan
from mixprec.compat import amp_casts, larc
from mixprec.compat import fp16_optimizer as fp16_utils
from mixprec.compat.amp_checkpoint import install_fp32_state_dict
from mixprec.compat.amp_handle import AmpHandle, NoOpHandle, step_without_casts
from mixprec.compat.apex_options import (
    ApexOptions,
    check_level,
    hint_dtype,
    refuse_wrapped,
    resolve_options,
)
from mixprec.compat.apex_state import AmpState
from mixprec.compat.fp16_optimizer import FP16_Optimizer

__all__ = ["AmpOptimizer", "FP16_Optimizer", "amp", "install", "uninstall"]


_state = AmpState()


def _print(level: int, msg: str) -> None:
    if _state.verbosity >= level:
        print(msg)


class AmpOptimizer(MixedPrecisionOptimizer):
    """What ``amp.initialize`` returns: a :class:`mixprec._core.optimizer.MixedPrecisionOptimizer`
    (itself a
    ``torch.optim.Optimizer``, so LR schedulers accept it) with Apex's step-time behaviour.

    * A skipped step prints Apex's "Gradient overflow. Skipping step" line at ``verbosity >= 1``.
    * ``step(closure)`` evaluates the closure once, then steps.
    * ``state_dict()`` loads into the plain torch optimizer; ``load_state_dict`` also takes a
      plain torch optimizer state dict (an Apex checkpoint).
    """

    _amp_verbosity = 1
    _amp_original: Any = None  # what the caller passed to initialize (a torch optimizer, a LARC)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:  # Apex raises; one evaluation then one step is what users mean
            with torch.enable_grad():
                loss = closure()
        step_without_casts(super().step)
        # (the base class drops the masters' grads after a step, as Apex does)
        if self.step_skipped and self._amp_verbosity >= 1:
            print(
                f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to "
                f"{self.loss_scale}"
            )
        return loss


def _as_list(obj: Any) -> tuple[list[Any], bool]:
    many = isinstance(obj, (list, tuple))
    return (list(obj) if many else [obj]), many


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    dtype: torch.dtype | None = None,
) -> Any:
    """Apex's ``amp.initialize`` on mixprec: same arguments, same return shapes.

    ``dtype`` (mixprec extension, keyword only) picks the 16-bit dtype at every level; Apex
    always uses float16. Returns ``models`` or ``(models, optimizers)``; the optimizers returned
    are :class:`AmpOptimizer` objects -- use them (as Apex's docs also require).
    """
    _state.verbosity = int(verbosity)
    if not enabled:
        _state.initialized, _state.enabled, _state.slots = True, False, []
        return models if optimizers is None else (models, optimizers)
    level = check_level(opt_level)
    model_list, many_models = _as_list(models)
    opt_list, many_opts = ([], False) if optimizers is None else _as_list(optimizers)
    refuse_wrapped(model_list, opt_list)
    opts = resolve_options(
        level,
        cast_model_type,
        patch_torch_functions,
        keep_batchnorm_fp32,
        master_weights,
        loss_scale,
        cast_model_outputs,
        int(num_losses),
        (min_loss_scale, max_loss_scale),
        dtype,
    )
    first = next((p for m in model_list for p in m.parameters()), None)
    hint = hint_dtype(opts, first.device if first is not None else torch.device("cpu"))
    if hint is not None and level != "O0":
        _print(1, hint)
    torch_opts = [as_torch_optimizer(o) for o in opt_list]
    wrapped, slots = _wrap(model_list, torch_opts, opts)
    _finish(model_list, opt_list, wrapped, slots, opts)
    out_models = model_list if many_models else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (wrapped if many_opts else wrapped[0])


def _wrap(
    model_list: list[nn.Module], torch_opts: list[Any], opts: ApexOptions
) -> tuple[list[MixedPrecisionOptimizer], list[LossSlot]]:
    """mixprec.initialize with the recipe Apex's options name; or, where Apex leaves the model
    alone (``cast_model_type=False``, O1 without patching), only masters and scaling."""
    # Apex's restore order (load_state_dict, then initialize) is initialize's own: the masters
    # start from the fp32 values the model holds, and the loaded state moves onto them.
    carried = [take_state(o) for o in torch_opts] if opts.leave_model else []
    try:
        if opts.leave_model:
            slots = [LossSlot(opts.scaler()) for _ in range(opts.num_losses)]
            wrapped = [
                MixedPrecisionOptimizer(o, slots, UpdatePlan(masters=opts.masters))
                for o in torch_opts
            ]
            for w, sd in zip(wrapped, carried):
                if sd is not None:
                    w.load_state_dict(sd)  # torch's layout, by index: onto the masters
            return wrapped, slots
        if _state.allow_incoming_model_not_fp32:  # 16-bit weights taken as they are
            for m in model_list:
                m.__dict__[ACCEPT_16BIT_ATTR] = True
        out = mixprec.initialize(model_list, torch_opts or None, opts.recipe())
        wrapped = out[1] if torch_opts else []
        return wrapped, wrapped[0].slots if wrapped else [
            LossSlot(opts.scaler()) for _ in range(opts.num_losses)
        ]
    except BaseException:
        for o, sd in zip(torch_opts, carried):
            if sd is not None and not o.state:
                o.load_state_dict(sd)  # give the caller's optimizer its state back
        for m in model_list:
            m.__dict__.pop(ACCEPT_16BIT_ATTR, None)
        raise


def _finish(
    model_list: list[nn.Module],
    opt_list: list[Any],
    wrapped: list[MixedPrecisionOptimizer],
    slots: list[LossSlot],
    opts: ApexOptions,
) -> None:
    """Apex's faces on the result: AmpOptimizer classes, the amp state, the O1 region."""
    for w, original in zip(wrapped, opt_list):
        w.__class__ = AmpOptimizer
        w._amp_verbosity = _state.verbosity
        w._amp_original = original
        _state.wrappers[id(original)] = w
    _state.slots = slots
    _state.initialized, _state.enabled = True, True
    _state.opt_properties = opts.properties()
    if _state.opt_properties.patch_torch_functions and not opts.leave_model:
        _o1_region(opts.dtype, model_list)
    if opts.level in ("O2", "O3") or opts.cast_model_type is False:
        for m in model_list:
            install_fp32_state_dict(m, wrapped)
    _print(
        1,
        f"mixprec amp: opt_level {opts.level}, dtype "
        f"{opts.dtype if opts.level != 'O0' else torch.float32}, master_weights "
        f"{opts.masters}, loss_scale {opts.spec}, num_losses {opts.num_losses}.",
    )


def _o1_region(dtype: torch.dtype, models: list[nn.Module]) -> None:
    """Apex's O1 patches every torch function for the process, so the loss computed from the
    model's 16-bit outputs runs under the cast lists too (``mean``, losses: fp32). The shim
    opens a mixprec region on this thread instead, once (a live one is reused), until
    ``amp._amp_state.handle._deactivate()`` or ``amp.reset()``."""
    live = _state.handle
    region = live._region if live is not None and live._live else None
    if region is not None and region.policy.compute_dtype == dtype:
        live._models.extend(models)
        return
    handle = AmpHandle(dtype=dtype, models=models, verbosity=_state.verbosity)
    _state.handles = [h for h in _state.handles if h._live] + [handle]
    _state.handle = handle


def _resolve_optimizers(optimizers: Any) -> list[MixedPrecisionOptimizer]:
    out = []
    for o in _as_list(optimizers)[0]:
        if isinstance(o, MixedPrecisionOptimizer):
            out.append(o)
        elif id(o) in _state.wrappers and _state.wrappers[id(o)]._amp_original is o:
            out.append(_state.wrappers[id(o)])  # the optimizer passed to initialize: its wrapper
        else:
            raise TypeError(
                f"amp.scale_loss got {type(o).__name__}, which was not passed "
                "through amp.initialize; pass the optimizer(s) it returned."
            )
    return out


@contextlib.contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``, as in Apex.

    On exit the gradients are unscaled (into the fp32 masters at O2) and checked; the next
    ``optimizer.step()`` is skipped if any was inf/NaN. ``model``, ``delay_unscale`` and
    ``delay_overflow_check`` are accepted for compatibility; each backward is always unscaled
    with its own scale, which makes ``delay_unscale`` unnecessary.
    """
    if not _state.initialized:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been "
            "initialized. model, optimizer = amp.initialize(model, optimizer, "
            "opt_level=...) must be called before `with amp.scale_loss`."
        )
    if not _state.enabled:
        yield loss
        return
    opts = _resolve_optimizers(optimizers)
    with mixprec.scale_loss(loss.float(), opts, loss_id=loss_id) as scaled:
        yield scaled
    if engine.is_active():  # an O1 region: its cached weight casts go stale at the next step
        torch.clear_autocast_cache()


def master_params(optimizer: Any) -> Iterator[Tensor]:
    """Every parameter the optimizer steps: the fp32 masters at O2, the model's own otherwise."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict | None = None) -> dict[str, Any]:
    """Apex's format, ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``, plus each
    scaler's full mixprec state under ``"mixprec"`` (so a resume is exact)."""
    out: dict[str, Any] = OrderedDict() if destination is None else destination
    for i, slot in enumerate(_state.slots):
        s = slot.scaler
        out[f"loss_scaler{i}"] = {
            "loss_scale": s.scale,
            "unskipped": s.growth_tracker,
            "mixprec": s.state_dict(),
        }
    return out


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the loss scalers from :func:`state_dict` (or a real Apex ``amp.state_dict()``)."""
    if len(state_dict) != len(_state.slots):
        print(
            f"Warning: state_dict contains {len(state_dict)} entries, while "
            f"{len(_state.slots)} loss_scalers are used"
        )
    items = list(state_dict.items())
    if len(items) > len(_state.slots):
        print("Error: more loss scalers in the state dict than in this amp; nothing loaded.")
        return
    for key, _ in items:
        if "loss_scaler" not in key:
            raise RuntimeError(f"Unexpected key {key!r} in amp state dict.")
    for slot, (_, value) in zip(_state.slots, items):
        s = slot.scaler
        if "mixprec" in value:
            s.load_state_dict(value["mixprec"])
        else:
            full = s.state_dict()
            full.update(scale=float(value["loss_scale"]), growth_tracker=int(value["unskipped"]))
            s.load_state_dict(full)


# -- disable_casts, reset, init ---------------------------------------------------------------


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turn mixprec's casts off inside the block: every op runs in its inputs' dtype."""
    handle = _state.handle
    if handle is not None and handle.is_active():
        with handle._disable_casts():
            yield
        return
    with mixprec.autocast("float32"):
        yield


def reset() -> None:
    """mixprec extension: undo registrations, close the regions of live ``amp.init`` handles
    and forget the amp state (tests, notebooks)."""
    for handle in reversed(_state.handles):
        handle._deactivate()
    amp_casts.undo_registrations()
    _state.__init__()


def init(
    enabled: bool = True,
    loss_scale: Any = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    *,
    dtype: torch.dtype = torch.float16,
) -> AmpHandle:
    """Apex's older API: ``handle = amp.init()`` opens a float16 mixprec region on this thread
    (O1 casting for every op until ``handle._deactivate()``) and returns the handle;
    ``handle.scale_loss(loss, optimizer)`` and ``handle.wrap_optimizer(optimizer, num_loss)``
    scale losses (:mod:`mixprec.compat.amp_handle`). ``enabled=False`` returns a handle that
    does nothing. ``dtype`` (mixprec extension) picks the 16-bit dtype."""
    if not enabled:
        handle: AmpHandle = NoOpHandle()
    else:
        handle = AmpHandle(
            loss_scale, enable_caching, verbose, dtype=dtype, verbosity=_state.verbosity
        )
        _state.handles = [h for h in _state.handles if h._live]
        _state.handles.append(handle)
    _state.handle = handle
    return handle


# -- the namespaces --------------------------------------------------------------------------

amp = types.ModuleType("mixprec.compat.apex.amp", "Apex's amp namespace, running on mixprec.")
for _fn in (
    initialize,
    scale_loss,
    master_params,
    state_dict,
    load_state_dict,
    amp_casts.register_half_function,
    amp_casts.register_float_function,
    amp_casts.register_promote_function,
    amp_casts.half_function,
    amp_casts.float_function,
    amp_casts.promote_function,
    disable_casts,
    init,
    reset,
):
    setattr(amp, _fn.__name__, _fn)
amp.AmpOptimizer = AmpOptimizer  # type: ignore[attr-defined]
amp._amp_state = _state  # type: ignore[attr-defined]

_INSTALLED: list[str] = []


def install() -> None:
    """Make ``import apex``, ``from apex import amp``, ``from apex.fp16_utils import
    FP16_Optimizer`` and ``from apex.parallel.LARC import LARC`` resolve to mixprec, for code
    you cannot edit. Refuses if a real ``apex`` package is already imported."""
    existing = sys.modules.get("apex")
    if existing is not None and not getattr(existing, "__mixprec__", False):
        raise RuntimeError("A real 'apex' package is already imported; mixprec will not shadow it.")
    apex = types.ModuleType("apex", "mixprec's stand-in for NVIDIA Apex (amp, fp16_utils).")
    apex.__mixprec__ = True  # type: ignore[attr-defined]
    apex.__path__ = []  # type: ignore[attr-defined]  # a package, so submodule imports work
    parallel = types.ModuleType("apex.parallel", "mixprec's stand-in for apex.parallel (LARC).")
    parallel.__path__ = []  # type: ignore[attr-defined]
    parallel.LARC = larc.LARC  # type: ignore[attr-defined]  # as Apex: the class shadows the module
    apex.amp = amp  # type: ignore[attr-defined]
    apex.fp16_utils = fp16_utils  # type: ignore[attr-defined]
    apex.parallel = parallel  # type: ignore[attr-defined]
    for name, module in (
        ("apex", apex),
        ("apex.amp", amp),
        ("apex.fp16_utils", fp16_utils),
        ("apex.parallel", parallel),
        ("apex.parallel.LARC", larc),
    ):
        sys.modules[name] = module
        _INSTALLED.append(name)


def uninstall() -> None:
    """Undo :func:`install`."""
    while _INSTALLED:
        sys.modules.pop(_INSTALLED.pop(), None)
