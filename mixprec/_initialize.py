"""``mixprec.initialize``: one call that turns a model and optimizer into a mixed-precision pair.

Design (Apex ``amp.initialize``): one entry point that takes the models, the optimizers and a
:class:`~mixprec.Recipe`, whose fields are every option (checked once, where the recipe is
built). It casts the storage, installs the forward boundary, wraps each optimizer with the plan
:mod:`mixprec._core.update.choice` gives it, and guards the optimizer passed in; the model is
modified in place and returned. The levels and update modes: ``docs/recipes.md``,
``docs/lean.md``; the walk through it: ``docs/design.md``, "One training step through the code".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mixprec._core import engine
from mixprec._core._gradients import LossSlot
from mixprec._core.fp32_values import install_load_refresh
from mixprec._core.hardware import set_storage_bytes, warn_if_slow
from mixprec._core.loss_scale import LossScaler
from mixprec._core.optimizer import MixedPrecisionOptimizer, StepGuard
from mixprec._core.optimizer_view import OptimizerView, as_torch_optimizer
from mixprec._core.policy import Policy, get_policy
from mixprec._core.resume import resume_carried, take_state
from mixprec._core.storage import ACCEPT_16BIT_ATTR, cast_storage, keep_frozen, restore_fp32
from mixprec._core.update.choice import UpdatePlan, resolved_for, update_plans
from mixprec._core.widening import install_widening
from mixprec.fp8 import layers as fp8_layers
from mixprec.recipe import Recipe, as_recipe

__all__ = ["MODEL_HOOKS", "RECIPE_ATTR", "initialize", "level_name"]

#: ``hook(model, optimizers)``, run for each model :func:`initialize` returns, with the wrapped
#: optimizers that step its parameters. The distributed layer adds one that notices a later
#: plain ``DDP(model)``; a registry keeps the core free of imports from the tools above it.
MODEL_HOOKS: list[Callable[[nn.Module, list[MixedPrecisionOptimizer]], None]] = []


def _storage_bytes(dtype: torch.dtype) -> dict[str, float]:
    """Storage-only precision's bytes per parameter with AdamW, and fp32's, by their tables."""
    table = Recipe("lean", dtype, compute="fp32").loop_bytes()
    return dict(plain=table["plain"], clip=table["clip"], fp32=Recipe("O0").loop_bytes()["plain"])


# the slow-hardware report and warning quote these (the same registry shape as MODEL_HOOKS)
set_storage_bytes(_storage_bytes)

_LEVELS = ("O0", "O1", "O2", "O3")
LEVEL_SPELLINGS = "'O0', 'O1', 'O2' or 'O3' (the letter O, not zero; any case: 'o2' is 'O2')"
_MARK = "_mixprec_initialized"
RECIPE_ATTR = "_mixprec_recipe"  # (recipe, the 16-bit dtype it runs in) on each model prepared


def level_name(level: Any) -> str:
    """``level`` as one of ``"O0"``-``"O3"``: names fold case, so ``"o2"`` is ``"O2"``."""
    name = level.upper() if isinstance(level, str) else level
    if name not in _LEVELS:
        raise ValueError(f"Unknown level {level!r}; expected {LEVEL_SPELLINGS}.")
    return name


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Optimizer | Sequence[Optimizer] | None = None,
    recipe: Recipe | str | Policy | Mapping[str, Any] = "O2",
    dtype: torch.dtype | str | None = None,
) -> Any:
    """Prepare models and optimizers for mixed-precision training.

    Args:
        models: a module or a list of modules (modified in place and returned).
        optimizers: an optimizer, a list of them, or None (inference / custom loops).
        recipe: a :class:`mixprec.Recipe`, a recipe name (``"O0"``-``"O3"``, ``"bf16-mixed"``,
            ...) or line (``"O3 bf16 update=none"``), a :class:`mixprec.Policy` (read by its
            three dtypes, as :meth:`mixprec.Recipe.from_policy` does), or a map
            ``{module path: policy}`` (e.g. :func:`mixprec.numerics.tune`'s plan), applied
            with ``set_policy`` at O1.
        dtype: the 16-bit dtype; None: the recipe's, else :func:`mixprec.default_dtype`.

    Returns:
        ``model`` or ``(model, optimizer)``, with lists where lists were given.
    """
    model_list, many_models = _as_list(models, nn.Module, "an nn.Module")
    many_opts = isinstance(optimizers, (list, tuple))
    given = [] if optimizers is None else optimizers if many_opts else [optimizers]
    opt_list = [as_torch_optimizer(o, "initialize") for o in given]  # LARC(SGD): a torch face
    _check_fresh(model_list, opt_list)
    if isinstance(recipe, Mapping):  # per-module policies, e.g. the plan tune returns
        _apply_plan(model_list, recipe)
        recipe = "O1"
    device = _device_of(model_list)
    recipe = as_recipe(recipe, dtype).resolve(device)  # every "auto" the device decides
    low = recipe.resolved_dtype(device)
    if recipe.compute == "16-bit":  # storage-only precision computes in fp32: fast anywhere
        warn_if_slow(low, device)
    plans = update_plans(recipe, opt_list, model_list, low)  # one per optimizer
    for m in model_list:
        accepted = m.__dict__.pop(ACCEPT_16BIT_ATTR, False)  # Apex's allow_incoming_model_not_fp32
        if m.__dict__.get("_mixprec_fsdp") or (accepted and recipe.weights == "fp32"):
            continue  # sharded: FSDP's shards are the fp32 state; O1 as given, as in Apex
        restore_fp32(m, recipe, low, warn=not accepted)
    fp32_values = _prepare_models(model_list, opt_list, plans, recipe, low, device)
    for m in model_list:
        m.__dict__[RECIPE_ATTR] = (recipe, low)
    wrapped = _wrap_optimizers(opt_list, plans, recipe, low, fp32_values)
    _install_guards(model_list, opt_list, wrapped, recipe.level)
    out_models = model_list if many_models else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (wrapped if many_opts else wrapped[0])


def _as_list(obj: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    many = isinstance(obj, (list, tuple))
    items = list(obj) if many else [obj]
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(
                f"initialize expects {what} (or a list of them), received {type(item).__name__}."
            )
    return items, many


def _apply_plan(model_list: list[nn.Module], plan: Mapping[str, Any]) -> None:
    if len(model_list) != 1:
        raise ValueError(
            f"A per-module policy map applies to one model; received "
            f"{len(model_list)} models. Call set_policy on each instead."
        )
    for path, module_policy in plan.items():
        try:
            target = model_list[0].get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"The policy map names module {path!r}, which "
                f"{type(model_list[0]).__name__} does not have."
            ) from None
        engine.set_policy(target, module_policy)


def _check_fresh(model_list: list[nn.Module], opt_list: list[Optimizer]) -> None:
    """Each model and optimizer initialized once, and every optimized parameter owned."""
    for m in model_list:
        _refuse_wrapped(m)
        if m.__dict__.get(_MARK):
            _refuse_twice(m)
    if any(isinstance(o, MixedPrecisionOptimizer) for o in opt_list):
        _refuse_twice(None)
    owned = {id(p) for m in model_list for p in m.parameters()}
    for i, o in enumerate(opt_list):
        foreign = [
            tuple(p.shape) for g in o.param_groups for p in g["params"] if id(p) not in owned
        ]
        if foreign:
            _refuse_foreign(i, foreign)


def _refuse_twice(model: nn.Module | None) -> None:
    """A model (or, for None, an optimizer) that initialize already prepared."""
    if model is not None:
        raise RuntimeError(
            f"initialize was already called on this {type(model).__name__}; call it "
            "once per model (build a fresh model to change the recipe)."
        )
    raise RuntimeError(
        "This optimizer was already returned by initialize; pass the original torch optimizer once."
    )


def _refuse_foreign(i: int, foreign: list[tuple[int, ...]]) -> None:
    raise ValueError(
        f"Optimizer {i} holds {len(foreign)} parameter(s) that none of the given models own "
        f"(shapes {foreign[:4]}...): pass every model whose parameters it optimizes."
    )


def _device_of(model_list: list[nn.Module]) -> torch.device:
    for m in model_list:  # all of the model on meta, or part of it (a lazily built submodule)
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            if t.device.type == "meta":
                _refuse_meta(name)
    first = next((p for m in model_list for p in m.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _refuse_meta(name: str) -> None:
    raise ValueError(
        f"initialize received a model on the 'meta' device ({name!r} is a meta tensor): its "
        "parameters have no data to cast or copy into fp32 masters. Materialize it first "
        "(model.to_empty(device=...) then load or initialize the weights), then call "
        "initialize; under FSDP2, mixprec.distributed.initialize_fsdp takes the meta model "
        "itself."
    )


def _prepare_models(
    model_list: list[nn.Module],
    opt_list: list[Optimizer],
    plans: list[UpdatePlan],
    recipe: Recipe,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[int, Tensor]:
    """Cast each model's storage and install its boundary; return the pre-cast fp32 values
    the masters and Kahan buffers start from."""
    to_keep = {
        id(p)
        for o, plan in zip(opt_list, plans)
        if plan.masters or plan.update == "kahan"
        for g in o.param_groups
        for p in g["params"]
    }
    fp32_values: dict[int, Tensor] = {}
    for m in model_list:
        if recipe.weights == "16-bit":
            if recipe.frozen_masters:
                keep_frozen(m)
            cast_storage(m, dtype, recipe.keep_fp32, to_keep, fp32_values)
        elif recipe.level == "O0":
            cast_storage(m, torch.float32, "none")
        _install_boundary(m, recipe, dtype)
        if recipe.fp8 is not None:  # chosen Linears run their GEMMs in FP8 (mixprec.fp8)
            fp8_layers.check_device(device)
            fp8_layers.prepare(m, recipe.fp8, device)
        m.__dict__[_MARK] = recipe.level
    return fp32_values


def _install_boundary(m: nn.Module, recipe: Recipe, dtype: torch.dtype) -> None:
    if m.__dict__.get("_mixprec_graph", False):  # mixprec.convert: casts are in its graph
        _install_storage_hooks(m, recipe, dtype)
    elif recipe.compute == "16-bit" or recipe.outputs is not None:
        m.__dict__[engine.BOUNDARY_ATTR] = engine.Boundary(
            get_policy(m) or recipe.policy(dtype),  # a set_policy'd root keeps its own
            cast_inputs=recipe.cast_inputs,
            fp32_inside=recipe.fp32_inside,
            kernels=recipe.kernels,
            cast_outputs=recipe.outputs is not None,
            activations=recipe.activations,
            widen=recipe.weights == "16-bit" and recipe.compute == "fp32",
        )
        engine.install_boundary(m)
        if recipe.weights == "16-bit" and recipe.compute == "fp32":
            install_widening(m)  # storage-only precision: weights widened per module


def _install_storage_hooks(m: nn.Module, recipe: Recipe, dtype: torch.dtype) -> None:
    """A converted graph's boundary: only the saved-tensor storage of ``activations=``."""
    if recipe.activations is not None:
        m.__dict__[engine.BOUNDARY_ATTR] = engine.Boundary(
            Policy(compute_dtype=dtype),
            cast_inputs=False,
            cast_outputs=False,
            activations=recipe.activations,
            engine=False,
        )
        engine.install_boundary(m)


def _wrap_optimizers(
    opt_list: list[Optimizer],
    plans: list[UpdatePlan],
    recipe: Recipe,
    dtype: torch.dtype,
    fp32_values: dict[int, Tensor],
) -> list[MixedPrecisionOptimizer]:
    """One wrapper per optimizer, sharing the loss slots (a scaler per loss); state loaded
    into the plain optimizer before initialize moves onto what the wrapper steps."""
    scaling = recipe.scaling(dtype)
    scaler = LossScaler.disabled if scaling is None else scaling.scaler
    slots = [LossSlot(scaler()) for _ in range(recipe.num_losses)]
    scale_given = scaling is not None and scaling.init_scale != 2.0**16
    carried = [take_state(o) for o in opt_list]
    try:
        wrapped = [
            MixedPrecisionOptimizer(
                o, slots, plan, fp32_values=fp32_values, recipe=resolved_for(recipe, plan)
            )
            for o, plan in zip(opt_list, plans)
        ]
        for w in wrapped:
            if w.updater is not None and w.updater.compensation:
                _start_compensation(w.updater.compensation, fp32_values)
        for w, sd in zip(wrapped, carried):
            if sd is not None:  # state loaded (or stepped) before initialize: onto the masters
                resume_carried(w, sd, fp32_values, scale_given)
    except BaseException:
        for o, sd in zip(opt_list, carried):
            if sd is not None and not o.state:
                o.load_state_dict(sd)  # give the caller's optimizer its state back
        raise
    fp32_values.clear()
    return wrapped


def _start_compensation(compensation: dict[Tensor, Tensor], fp32_values: dict[int, Tensor]) -> None:
    """Kahan's compensation starts as what the cast dropped: the fp32 value less the 16-bit one."""
    for p, comp in compensation.items():
        given = fp32_values.get(id(p))
        if given is not None and given.shape == p.shape:
            comp.copy_((given.float() - p.detach().float()).to(comp.dtype))


def _install_guards(
    model_list: list[nn.Module],
    opt_list: list[Optimizer],
    wrapped: list[MixedPrecisionOptimizer],
    level: str,
) -> None:
    """The original optimizers refuse a direct step; loads refresh masters; model hooks run."""
    for o, w in zip(opt_list, wrapped):
        inner = o.wrapper if isinstance(o, OptimizerView) else o
        if hasattr(inner, "register_step_pre_hook"):
            inner.register_step_pre_hook(StepGuard(w, level))
    install_load_refresh(wrapped, model_list)
    for m in model_list if wrapped else ():  # e.g. a plain DDP(model) later: same skips
        own = {id(p) for p in m.parameters()}
        mine = [o for o in wrapped if any(id(p) in own for p in o.model_params())]
        for hook in MODEL_HOOKS:
            hook(m, mine)


def _refuse_wrapped(m: nn.Module) -> None:
    """initialize must see the bare model: DDP/FSDP register buckets and shards on the
    parameters that initialize may re-cast, and would then all-reduce stale tensors."""
    names = {c.__name__ for c in type(m).__mro__}
    sharded = names & {"FSDPModule", "FullyShardedDataParallel"}
    if "DistributedDataParallel" in names or (sharded and not m.__dict__.get("_mixprec_fsdp")):
        _refuse_distributed(m, "DistributedDataParallel" in names)


def _refuse_distributed(m: nn.Module, ddp: bool) -> None:
    if ddp:
        raise TypeError(
            "initialize received a DistributedDataParallel model. Call "
            "mixprec.initialize(model, optimizer, recipe) on the bare model, "
            "then mixprec.distributed.wrap_ddp(model, optimizer)."
        )
    raise TypeError(
        f"initialize received an FSDP-sharded model ({type(m).__name__}). Use "
        "mixprec.distributed.initialize_fsdp(model, optimizer_fn, recipe), "
        "which shards with a matching MixedPrecisionPolicy."
    )
