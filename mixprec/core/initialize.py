"""``mixprec.initialize``: one call that turns a model and optimizer into a mixed-precision pair.

Design (Apex ``amp.initialize`` semantics; ``docs/design.md``, "Master weights and the optimizer"):
an opt level is a bundle of properties; keyword overrides change single properties and are validated
together.

| level | parameters | forward | outputs | masters | loss scaling (fp16 / bf16) |
|---|---|---|---|---|---|
| O0 | fp32 | fp32 | fp32 | no | off / off |
| O1 | fp32 | cast table (eager engine) | fp32 | no (fp32 already) | dynamic / off |
| O2 | 16-bit, norms fp32 | 16-bit, cast table, inputs cast at entry | fp32 | fp32 | dynamic / off |
| O3 | 16-bit everywhere | 16-bit, cast table, inputs cast at entry | fp32 | no | dynamic / off |

At O2/O3 memory-bound ops with fp32-accumulating kernels (layer_norm, softmax) keep 16-bit
inputs and outputs (``fp32_inside``).

Without masters (O3), ``update="nearest" | "kahan" | "stochastic"`` runs the optimizer's math in
fp32 on temporaries and writes the 16-bit weights back with that rounding, with optimizer state
stored per ``state_dtype`` (:mod:`mixprec.core.lean`). ``update=None`` lets the optimizer step the
16-bit weights in 16-bit arithmetic. The default, chosen per optimizer when ``update`` is not
given:

* **bf16: ``"kahan"``.** bf16 keeps 8 significant bits: the optimizer's own bf16 step loses
  every update below half an ulp of its weight, and its bf16 second moment stops decaying
  (``v <- 0.999 v`` rounds back to ``v``), so training stalls once updates get small and ends
  below fp32's accuracy (``docs/lean.md`` measures it on an MNIST-1D CNN). ``"kahan"`` keeps
  fp32's accuracy there. The cost, paid by default rather than in accuracy: +2 bytes per
  parameter for the compensation buffer, +2 more with an Adam-family optimizer (its second
  moment is fp32: 12 instead of 8 bytes per parameter with AdamW), and a slower optimizer
  step (the fp32 math on chunked temporaries is about 8 memory passes, and Python work per
  chunk). ``update=None`` is the cheaper step for whoever accepts the accuracy loss.
* **fp16: ``"kahan"``** with an Adam-family optimizer (``betas`` in its defaults) or any
  optimizer whose ``eps`` rounds to 0 in fp16 (RMSprop's 1e-8): in fp16 arithmetic such an eps
  rounds to 0 and Adam's second moment underflows, which turned weights NaN on the first step.
  Other fp16 optimizers (SGD) keep their own fp16 step.
* **None wherever gradients are sparse** (``SparseAdam``, an optimizer holding the weight of an
  ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``): update modes need dense gradients.

``state_dtype`` and ``update_seed`` apply to the optimizers whose update (given or default) is a
mode. ``update=None`` restores the optimizer's own 16-bit step. A Kahan buffer starts from the
residual of rounding the values the parameters held before the cast, as masters start from those
values, so loading fp32 weights before or after ``initialize`` gives the same ``w + c``. An
``update=None`` checkpoint (or one from before update modes existed) resumes under ``"kahan"``
with zero compensation; a checkpoint with an update mode is refused by ``update=None``, whose
16-bit step would drop the compensation.

A model that arrives already cast to 16 bits gets back what its level keeps in fp32 (all of
it at O0/O1, the norm layers at O2) with one warning: the fp32 values start from the rounded
ones, which no cast can undo, and a silent 16-bit O1 (or fp16/bf16 mix at O2) broke the level's
promise. The optimizer passed in refuses a direct step that would bypass the returned one.

A non-finite gradient skips the step at every level, with or without loss scaling. The model is
modified in place (hooks, parameter storage) and returned.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mixprec.core import engine
from mixprec.core.activations import as_activation_config
from mixprec.core.fp8 import layers as fp8_layers
from mixprec.core.fp8.config import as_fp8_config
from mixprec.core.hardware import default_dtype, warn_if_slow
from mixprec.core.loss_scale import DYNAMIC_OPTIONS, LossScaler
from mixprec.core.norms import is_norm
from mixprec.core.optimizer import (
    LossSlot,
    MixedPrecisionOptimizer,
    StepGuard,
    rounds_to,
    scale_loss,
    take_state,
)
from mixprec.core.optimizer_view import OptimizerView, as_torch_optimizer
from mixprec.core.policy import Policy, PolicyLike, as_policy, get_policy
from mixprec.core.resume import kahan_fp32, merge_compensation, resume_carried

__all__ = ["LEVELS", "MODEL_HOOKS", "fp32_state_dict", "initialize", "level_name", "scale_loss"]

#: ``hook(model, optimizers)``, run for each model :func:`initialize` returns, with the wrapped
#: optimizers that step its parameters. The distributed layer adds one that notices a later
#: plain ``DDP(model)``; a registry keeps the core free of imports from the tools above it.
MODEL_HOOKS: list[Callable[[nn.Module, list[MixedPrecisionOptimizer]], None]] = []

LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(
        cast_params=False,
        engine=False,
        keep_norm_fp32=None,
        master_weights=False,
        cast_inputs=False,
        fp32_inside=False,
    ),
    "O1": dict(
        cast_params=False,
        engine=True,
        keep_norm_fp32=None,
        master_weights=False,
        cast_inputs=False,
        fp32_inside=False,
    ),
    "O2": dict(
        cast_params=True,
        engine=True,
        keep_norm_fp32=True,
        master_weights=True,
        cast_inputs=True,
        fp32_inside=True,
    ),
    "O3": dict(
        cast_params=True,
        engine=True,
        keep_norm_fp32=False,
        master_weights=False,
        cast_inputs=True,
        fp32_inside=True,
    ),
}
LEVEL_SPELLINGS = "'O0', 'O1', 'O2' or 'O3' (the letter O, not zero; any case: 'o2' is 'O2')"


def level_name(level: Any) -> str:
    """``level`` as its key in :data:`LEVELS`: names fold case, so ``"o2"`` is ``"O2"``."""
    name = level.upper() if isinstance(level, str) else level
    if name not in LEVELS:
        raise ValueError(f"Unknown level {level!r}; expected {LEVEL_SPELLINGS}.")
    return name


_SCALER_KEYS = ("init_scale", *DYNAMIC_OPTIONS)
_LEAN_KEYS = ("update", "state_dtype", "update_seed")
_OVERRIDES = (
    "keep_norm_fp32",
    "keep_frozen_fp32",
    "master_weights",
    "loss_scale",
    "cast_model_outputs",
    "num_losses",
    "fp32_inside",
    "kernels",
    "fp8",
    "activations",
    *_LEAN_KEYS,
    *_SCALER_KEYS,
)
_MARK = "_mixprec_initialized"
_LOW = (torch.float16, torch.bfloat16)
_SECOND_ROUNDING = {
    torch.bfloat16: "to bfloat16's 8 significant bits, float16 has 11",
    torch.float16: "into float16's range: beyond 65504 overflows, below 6e-8 flushes to 0",
}
#: set on a model by a caller that takes it in whatever dtypes it has (Apex's
#: ``allow_incoming_model_not_fp32``): kept as it is at O0/O1, cast without a warning at O2/O3
ACCEPT_16BIT_ATTR = "_mixprec_accept_16bit"
FROZEN_ATTR = "_mixprec_frozen_fp32"  # {param name in its module: fp32 copy}, keep_frozen_fp32


def _as_list(obj: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    many = isinstance(obj, (list, tuple))
    items = list(obj) if many else [obj]
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(
                f"initialize expects {what} (or a list of them), received {type(item).__name__}."
            )
    return items, many


def _level_from_policy(policy: Policy) -> str:
    if not policy.is_lower:
        return "O0"
    return "O1" if policy.param_dtype == torch.float32 else "O3"


def _overflows(before: Tensor, after: Tensor) -> bool:
    """True when the cast made a finite value infinite, or a nonzero value zero."""
    return bool(
        (torch.isfinite(before) & ~torch.isfinite(after)).any()
        or ((before != 0) & (after == 0)).any()
    )


def _cast_storage(
    module: nn.Module,
    dtype: torch.dtype,
    keep_norm: bool,
    keep: set[int] | None = None,
    kept: dict[int, Tensor] | None = None,
) -> None:
    """Store parameters and floating buffers in ``dtype``; Parameter objects keep identity.

    The parameters whose id is in ``keep`` leave their pre-cast value in ``kept`` (a copy, made
    one parameter at a time, so the peak stays one parameter above the cast model plus masters).
    """
    own = get_policy(module)
    if own is not None:
        dtype = own.param_dtype
    if not (keep_norm and is_norm(module)):
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float64 and p.dtype != dtype:
                if keep is not None and kept is not None and id(p) in keep and id(p) not in kept:
                    kept[id(p)] = p.detach().clone()
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != torch.float64:
                cast = b.to(dtype)
                if _overflows(b, cast):  # e.g. 1e5 in fp16: inf, then NaN outputs, all skipped
                    warnings.warn(
                        f"Buffer {type(module).__name__}.{name} holds values outside {dtype}'s "
                        f"range (|x| up to {b.abs().max().item():.3g}, nonzero values that "
                        f"would flush to 0 or overflow); it stays "
                        f"{b.dtype}.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    continue
                module._buffers[name] = cast
    for child in module.children():
        _cast_storage(child, dtype, keep_norm, keep, kept)


def restore_fp32(
    model: nn.Module, level: str, dtype: torch.dtype, props: dict[str, Any], warn: bool = True
) -> None:
    """A model that arrives already cast to 16 bits (``model.half()``, ``.to(torch.bfloat16)``)
    gets back what the level keeps in float32 -- every parameter at O0/O1, the norm layers at O2
    (their buffers too: BatchNorm's running statistics) -- and one warning: the fp32 weights or
    masters start from the rounded 16-bit values, which no cast can undo. At O3 (16-bit
    everywhere, no masters) a model in the *other* 16-bit dtype is converted by the cast that
    follows, rounding it a second time: warned too. A model in the level's own dtype at O3 is
    what O3 stores anyway."""
    found: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    total = widened = 0
    for module in model.modules():
        fp32 = not props["cast_params"] or (props["keep_norm_fp32"] and is_norm(module))
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            total += 1
            if p.dtype in _LOW:
                found[p.dtype] = found.get(p.dtype, 0) + 1
                if fp32:
                    p.data = p.data.to(torch.float32)
                    widened += 1
    if not found:
        return
    for module in model.modules():  # the buffers beside the parameters the level keeps fp32
        if not props["cast_params"] or (props["keep_norm_fp32"] and is_norm(module)):
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.dtype in _LOW:
                    module._buffers[name] = b.to(torch.float32)
    if warn:
        _warn_16bit(found, total, widened, level, dtype, props)


def _warn_16bit(
    found: dict[torch.dtype, int],
    total: int,
    widened: int,
    level: str,
    dtype: torch.dtype,
    props: dict[str, Any],
) -> None:
    """The one warning of :func:`restore_fp32`: what arrived, what the level keeps, the fix."""
    names = " and ".join(f"{d} ({n} of {total} parameters)" for d, n in found.items())
    if not props["cast_params"]:
        keeps, starts = "every parameter", "the float32 weights"
    elif props["master_weights"]:
        keeps = "norm layers and master weights" if widened else "master weights"
        starts = "the float32 master weights"
    else:
        other = [d for d in found if d != dtype]
        if other:
            warnings.warn(
                f"initialize received a model in {names}: level {level} stores every weight "
                f"in {dtype}, so its {other[0]} weights are converted, rounding them a second "
                f"time ({_SECOND_ROUNDING[dtype]}). Pass dtype={other[0]} to keep them as they "
                "are, or build or load the model in float32 and let initialize cast it.",
                UserWarning,
                stacklevel=4,
            )
        return
    warnings.warn(
        f"initialize received a model already cast to {names}: level {level} keeps {keeps} "
        f"in float32, so initialize upcasts them, but {starts} start from the rounded 16-bit "
        f"values, not from the float32 values they were cast from. Build or load the model in "
        f"float32 and let initialize cast it: drop the model.half() / "
        f"model.to({next(iter(found))}) before initialize.",
        UserWarning,
        stacklevel=4,
    )


def _resolve(
    level: str | None,
    dtype: Any,
    policy: PolicyLike | None,
    device: torch.device,
    overrides: dict[str, Any],
) -> tuple[str, torch.dtype, dict[str, Any]]:
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise TypeError(f"Unknown initialize option(s) {unknown}; allowed: {sorted(_OVERRIDES)}.")
    if policy is not None:
        if dtype is not None:
            raise ValueError("Give policy= or dtype=, not both: the policy carries the dtype.")
        pol = as_policy(policy)
        level = level or _level_from_policy(pol)
        dtype = pol.compute_dtype
        overrides.setdefault("cast_model_outputs", pol.output_dtype)
    level = level_name(level or "O1")
    if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        raise TypeError(
            f"dtype must be a floating dtype (torch.bfloat16 or torch.float16 for "
            f"O1-O3), received {dtype}."
        )
    if dtype is None:
        dtype = torch.float32 if level == "O0" else default_dtype(device)
    elif isinstance(dtype, str):
        try:  # a dtype name ("fp32", "f16", "bfloat16", ...), else a policy's compute dtype
            dtype = Policy(compute_dtype=dtype).compute_dtype
        except ValueError:
            dtype = as_policy(dtype).compute_dtype
    if level == "O0" and dtype != torch.float32:
        raise ValueError(
            f"Level O0 trains in float32, so dtype={dtype} would be ignored: drop "
            "dtype=, or choose O1, O2 or O3 to train in it."
        )
    if level != "O0" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"Level {level} needs a 16-bit dtype (torch.bfloat16 or torch.float16), "
            f"received {dtype}. Use level='O0' for float32 training."
        )
    props = dict(LEVELS[level])
    if "keep_norm_fp32" in overrides and not props["cast_params"]:
        raise ValueError(
            f"keep_norm_fp32 only applies where parameters are cast (O2, O3); "
            f"level {level} keeps every parameter in float32."
        )
    if overrides.get("master_weights") and not props["cast_params"]:
        raise ValueError(
            f"master_weights=True needs 16-bit parameters (O2, O3); at level {level} "
            "the parameters are already float32."
        )
    if overrides.get("fp32_inside") and not props["engine"]:
        raise ValueError("fp32_inside only applies with the eager engine (O1-O3).")
    if overrides.get("keep_frozen_fp32") and not props["cast_params"]:
        raise ValueError(
            f"keep_frozen_fp32 only applies where parameters are cast (O2, O3); "
            f"level {level} keeps every parameter in float32."
        )
    props["keep_frozen_fp32"] = bool(overrides.pop("keep_frozen_fp32", False))
    props["fp8"] = as_fp8_config(overrides.pop("fp8", None))
    if props["fp8"] is not None and not props["engine"]:
        raise ValueError(
            f"fp8= runs chosen Linears in FP8 inside a 16-bit level; level {level} trains in "
            "float32. Use level='O1', 'O2' or 'O3'."
        )
    for key in ("keep_norm_fp32", "master_weights", "fp32_inside", "kernels", "cast_model_outputs"):
        if key in overrides:
            props[key] = overrides.pop(key)
    props["activations"] = as_activation_config(overrides.pop("activations", None))
    storage = getattr(props["activations"], "storage", None)
    if storage == "16-bit" and not props["engine"]:
        raise ValueError(
            "activations='16-bit' stores float32 saved tensors in the compute dtype; level "
            f"{level} has none (it trains in float32). Use 'fp8', or a level O1-O3."
        )
    props.setdefault("kernels", "auto")
    props.setdefault("cast_model_outputs", torch.float32)
    lean = {k: overrides.pop(k) for k in _LEAN_KEYS if k in overrides}
    if lean.get("update") is not None and (not props["cast_params"] or props["master_weights"]):
        has = "master weights" if props["cast_params"] else "fp32 parameters"
        raise ValueError(
            f"update={lean['update']!r} updates 16-bit weights without fp32 masters; "
            f"level {level} has {has}. Use level='O3' (or O2 with "
            "master_weights=False)."
        )
    # state_dtype / update_seed need an update mode: an explicit one, or O3's default (decided
    # per optimizer in initialize)
    if (
        set(lean) - {"update"}
        and lean.get("update") is None
        and ("update" in lean or not _lean_level(props))
    ):
        _refuse_mode_options(lean)
    props["lean"] = lean
    spec = overrides.pop(
        "loss_scale", "dynamic" if dtype == torch.float16 and level != "O0" else None
    )
    num_losses = overrides.pop("num_losses", 1)
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, received {num_losses!r}.")
    first = LossScaler.from_spec(spec, **overrides)
    # One scaler per loss: a LossScaler instance given as the spec serves loss 0 and the other
    # losses get independent copies (sharing it would update it once per loss per step).
    props["scalers"] = [first] + [copy.deepcopy(first) for _ in range(num_losses - 1)]
    return level, dtype, props


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Optimizer | Sequence[Optimizer] | None = None,
    level: str | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    policy: PolicyLike | None = None,
    **overrides: Any,
) -> Any:
    """Prepare models and optimizers for mixed-precision training.

    Args:
        models: a module or a list of modules (modified in place and returned).
        optimizers: an optimizer, a list of them, or None (inference / custom loops).
        level: "O0", "O1" (default), "O2" or "O3" (any case) -- see the module docstring's table.
        dtype: the 16-bit dtype; None picks :func:`mixprec.default_dtype` for the device.
        policy: any policy spelling, instead of ``level`` + ``dtype``; or a map ``{module path:
            policy}`` (e.g. :func:`mixprec.tune`'s plan) applied with ``set_policy`` first.
        **overrides: ``keep_norm_fp32``, ``master_weights``, ``loss_scale`` ("dynamic" | float |
            None), ``cast_model_outputs`` (dtype or None), ``num_losses``, ``fp32_inside``,
            ``kernels``, ``fp8`` (True, ``"tensorwise"``, ``"rowwise"`` or a
            :class:`mixprec.FP8Config`: chosen Linears run their GEMMs in FP8, see
            :mod:`mixprec.core.fp8`), the :class:`LossScaler` settings (``init_scale``,
            ``growth_interval``, ``hysteresis``, ``min_scale``, ...) and, without masters,
            ``update`` (None | "nearest" | "kahan" | "stochastic"; default "kahan" in bf16,
            see the module docstring), ``state_dtype`` ("auto" | dtype | {key: dtype}) and
            ``update_seed`` (int) -- see :mod:`mixprec.core.lean`; ``activations`` (None |
            ``"fp8"`` | ``"16-bit"`` | :class:`~mixprec.core.activations.ActivationConfig`):
            how the tensors the model's forward saves for backward are stored.

    Returns:
        ``model`` or ``(model, optimizer)``, with lists where lists were given.

    Example:
        >>> model, opt = initialize(torch.nn.Linear(4, 4), torch.optim.SGD(
        ...     torch.nn.Linear(4, 4).parameters(), lr=0.1))  # doctest: +SKIP
    """
    model_list, many_models = _as_list(models, nn.Module, "an nn.Module")
    many_opts = isinstance(optimizers, (list, tuple))
    opt_list = (
        []
        if optimizers is None
        # an optimizer wrapper (LARC(SGD(...))) gets a torch.optim.Optimizer face
        else [
            as_torch_optimizer(o, "initialize") for o in (optimizers if many_opts else [optimizers])
        ]
    )
    plan = None
    if isinstance(policy, Mapping):  # per-module policies, e.g. the plan mixprec.tune returns
        if len(model_list) != 1:
            raise ValueError(
                f"A per-module policy map applies to one model; received "
                f"{len(model_list)} models. Call set_policy on each instead."
            )
        plan, policy = policy, None
    for m in model_list:
        _refuse_wrapped(m)
        if m.__dict__.get(_MARK):
            raise RuntimeError(
                f"initialize was already called on this {type(m).__name__}; call it "
                "once per model (build a fresh model to change the level)."
            )
    for o in opt_list:
        if isinstance(o, MixedPrecisionOptimizer):
            raise RuntimeError(  # noqa: TRY004 - right type, used twice: a state error
                "This optimizer was already returned by initialize; pass the "
                "original torch optimizer once."
            )
    owned = {id(p) for m in model_list for p in m.parameters()}
    for i, o in enumerate(opt_list):
        foreign = [
            tuple(p.shape) for g in o.param_groups for p in g["params"] if id(p) not in owned
        ]
        if foreign:
            raise ValueError(
                f"Optimizer {i} holds {len(foreign)} parameter(s) that none of the "
                f"given models own (shapes {foreign[:4]}...): pass every model whose "
                "parameters it optimizes."
            )
    if plan is not None:
        for path, module_policy in plan.items():
            try:
                target = model_list[0].get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"The policy map names module {path!r}, which "
                    f"{type(model_list[0]).__name__} does not have."
                ) from None
            engine.set_policy(target, module_policy)
    first = next((p for m in model_list for p in m.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    on_meta = next(
        (
            name
            for m in model_list
            for name, t in (*m.named_parameters(), *m.named_buffers())
            if t.device.type == "meta"
        ),
        None,
    )
    if on_meta is not None:  # all of the model, or part of it (a lazily built submodule)
        raise ValueError(
            f"initialize received a model on the 'meta' device ({on_meta!r} is "
            "a meta tensor): its parameters have no data to cast or copy into "
            "fp32 masters. Materialize it first (model.to_empty(device=...) then "
            "load or initialize the weights), then call initialize."
        )
    level, dtype, props = _resolve(level, dtype, policy, device, dict(overrides))
    if level != "O0":
        warn_if_slow(dtype, device, stacklevel=3)

    lean_kwargs = [dict(props["lean"]) for _ in opt_list]
    if _lean_level(props):
        sparse = _sparse_grad_params(model_list)
        for i, (o, kw) in enumerate(zip(opt_list, lean_kwargs)):
            if "update" not in kw:
                kw["update"] = _default_update(o, dtype, sparse)
                if kw["update"] is None:  # state_dtype / update_seed go where a mode runs
                    kw = lean_kwargs[i] = {"update": None}
        if set(props["lean"]) - {"update"} and all(kw["update"] is None for kw in lean_kwargs):
            _refuse_mode_options(props["lean"])
        # an update mode does its arithmetic in fp32; 16-bit arithmetic may lose eps
        _warn_vanishing_eps(
            [o if kw["update"] is None else None for o, kw in zip(opt_list, lean_kwargs)], dtype
        )

    for m in model_list:
        accepted = m.__dict__.pop(ACCEPT_16BIT_ATTR, False)  # Apex's allow_incoming_model_not_fp32
        if m.__dict__.get("_mixprec_fsdp") or (accepted and not props["cast_params"]):
            continue  # sharded: FSDP's shards are the fp32 state; O1 as given, as in Apex
        restore_fp32(m, level, dtype, props, warn=not accepted)

    # The masters start from the exact values the model holds now, not from its 16-bit rounding
    # (load pretrained fp32 weights, then initialize): copies of the parameters the optimizers
    # step, handed to the optimizer wrapper as its masters. Kahan compensation starts from the
    # residual of that rounding, so w + c keeps what the masters would.
    to_keep = {
        id(p)
        for o, kw in zip(opt_list, lean_kwargs)
        if props["master_weights"] or kw.get("update") == "kahan"
        for g in o.param_groups
        for p in g["params"]
    }
    fp32_values: dict[int, Tensor] = {}
    for m in model_list:
        if props["cast_params"]:
            if props["keep_frozen_fp32"]:  # exact fp32 values for fp32_state_dict, 4 B/param
                for sub in m.modules():  # by name, so the model still pickles
                    frozen = {
                        n: p.detach().float().clone()
                        for n, p in sub._parameters.items()
                        if p is not None and not p.requires_grad and p.is_floating_point()
                    }
                    if frozen:
                        sub.__dict__[FROZEN_ATTR] = frozen
            _cast_storage(m, dtype, bool(props["keep_norm_fp32"]), to_keep, fp32_values)
        elif level == "O0":
            _cast_storage(m, torch.float32, False)
        graph = m.__dict__.get("_mixprec_graph", False)  # mixprec.convert: casts are in its graph
        if graph and props["activations"] is not None:  # the graph needs only the storage hooks
            m.__dict__[engine.BOUNDARY_ATTR] = engine.Boundary(
                Policy(compute_dtype=dtype),
                cast_inputs=False,
                cast_outputs=False,
                activations=props["activations"],
                engine=False,
            )
            engine.install_boundary(m)
        if (props["engine"] or props["cast_model_outputs"] is not None) and not graph:
            outputs = props["cast_model_outputs"]
            root = get_policy(m) or Policy(
                param_dtype=dtype if props["cast_params"] else torch.float32,
                compute_dtype=dtype if props["engine"] else torch.float32,
                output_dtype=outputs or torch.float32,
            )
            spec = engine.Boundary(
                root,
                cast_inputs=props["cast_inputs"],
                fp32_inside=props["fp32_inside"],
                kernels=props["kernels"],
                cast_outputs=outputs is not None,
                activations=props["activations"],
            )
            m.__dict__[engine.BOUNDARY_ATTR] = spec
            engine.install_boundary(m)
        if props["fp8"] is not None:  # chosen Linears run their GEMMs in FP8 (mixprec.core.fp8)
            fp8_layers.check_device(device)
            fp8_layers.prepare(m, props["fp8"], device)
        m.__dict__[_MARK] = level

    slots = [LossSlot(s) for s in props["scalers"]]
    # Apex's and nanoGPT's restore order -- load the checkpoint into the plain model and
    # optimizer, then initialize -- and a resumed torch.amp run: the optimizer's state (with
    # mixprec's entry, which a plain load keeps) is lifted out and loaded again, by index, onto
    # what the wrapper steps (the fp32 masters at O2), checked against the model's weights
    carried = [take_state(o) for o in opt_list]
    scale_given = "init_scale" in overrides or isinstance(overrides.get("loss_scale"), LossScaler)
    try:
        wrapped = [
            MixedPrecisionOptimizer(
                o,
                slots,
                master_weights=props["master_weights"],
                fp32_values=fp32_values,
                **kw,
            )
            for o, kw in zip(opt_list, lean_kwargs)
        ]
        for w in wrapped:
            for p, comp in w.lean.compensation.items() if w.lean is not None else ():
                given = fp32_values.get(id(p))
                if given is not None and given.shape == p.shape:
                    comp.copy_((given.float() - p.detach().float()).to(comp.dtype))
        for w, sd in zip(wrapped, carried):
            if sd is not None:  # state loaded (or stepped) before initialize: onto the masters
                resume_carried(w, sd, fp32_values, scale_given)
    except BaseException:
        for o, sd in zip(opt_list, carried):
            if sd is not None and not o.state:
                o.load_state_dict(sd)  # give the caller's optimizer its state back
        raise
    fp32_values.clear()
    for o, w in zip(opt_list, wrapped):
        inner = o.wrapper if isinstance(o, OptimizerView) else o
        if hasattr(inner, "register_step_pre_hook"):
            inner.register_step_pre_hook(StepGuard(w, level))
    refresh = _LoadRefresh(wrapped, model_list)
    for model in model_list:
        for m in model.modules():  # every module: a submodule may be loaded on its own
            if m._parameters:
                m.register_load_state_dict_pre_hook(refresh.before)
                m.register_load_state_dict_post_hook(refresh.after)
    for m in model_list if wrapped else ():  # e.g. a plain DDP(model) later: same skips
        own = {id(p) for p in m.parameters()}
        mine = [o for o in wrapped if any(id(p) in own for p in o.model_params())]
        for hook in MODEL_HOOKS:
            hook(m, mine)
    out_models = model_list if many_models else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (wrapped if many_opts else wrapped[0])


class _LoadRefresh:
    """Keeps fp32 masters (and Kahan compensation) in step with ``model.load_state_dict``.

    Loading weights after initialize (build, initialize, load pretrained) writes the model's
    16-bit parameters; without this the next step would copy the stale masters back over them.
    The masters take the *loaded* values (an fp32 checkpoint, e.g. from :func:`fp32_state_dict`,
    round-trips exactly), and a loaded parameter's compensation is reset. Parameters are matched
    by identity, so a deep copy of the model (new parameters) never touches these optimizers.
    """

    def __init__(self, optimizers: list[MixedPrecisionOptimizer], models: list[nn.Module]) -> None:
        self.masters: dict[int, tuple[weakref.ref, Tensor]] = {}
        for model in models:  # keep_frozen_fp32 copies are masters without an optimizer
            for m in model.modules():
                for name, fp32 in m.__dict__.get(FROZEN_ATTR, {}).items():
                    p = m._parameters[name]
                    self.masters[id(p)] = (weakref.ref(p), fp32)
        self.lean: dict[int, tuple[weakref.ref, Any]] = {}
        for o in optimizers:
            for p, master in o._pairs:
                self.masters[id(p)] = (weakref.ref(p), master)
            if o.lean is not None:
                for g in o.param_groups:
                    for p in g["params"]:
                        self.lean[id(p)] = (weakref.ref(p), o.lean)
        self.pending: list[tuple[Tensor, Any, Tensor]] = []

    def __getstate__(self) -> dict[str, Any]:
        # weakrefs do not pickle, and a pickled model is a copy with other parameters: its
        # hooks refresh nothing (torch.save(model) must keep working after initialize)
        return {"masters": {}, "lean": {}, "pending": []}

    def before(
        self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any
    ) -> None:
        for name, p in module._parameters.items():
            src = state_dict.get(prefix + name)
            if p is None or not isinstance(src, Tensor):
                continue
            for table in (self.masters, self.lean):
                hit = table.get(id(p))
                if hit is not None and hit[0]() is p:
                    same = src.dtype == p.dtype and torch.equal(src, p.detach())
                    self.pending.append((p, hit[1], src, same))

    @torch.no_grad()
    def after(self, module: nn.Module, incompatible: Any) -> None:
        pending, self.pending = self.pending, []
        for p, target, src, same in pending:
            if isinstance(target, Tensor):
                if src.shape != target.shape or rounds_to(target, src):
                    continue  # a 16-bit copy of this very master (a resume): keep its precision
                target.copy_(src)
                continue
            comp = target.compensation.get(p)  # a LeanUpdate's Kahan buffer
            if comp is not None and not same and src.dtype.itemsize > p.dtype.itemsize:
                # a wider load (pretrained fp32): the residual of rounding it, except where
                # w + c already is the loaded value (fp32_state_dict of the state restored
                # before). A 16-bit load keeps the buffer: it is a resume, whose optimizer
                # state restored it.
                comp.copy_(merge_compensation(src.to(p.device), p, comp))


def _refuse_wrapped(m: nn.Module) -> None:
    """initialize must see the bare model: DDP/FSDP register buckets and shards on the
    parameters that initialize may re-cast, and would then all-reduce stale tensors."""
    names = {c.__name__ for c in type(m).__mro__}
    if "DistributedDataParallel" in names:
        raise TypeError(
            "initialize received a DistributedDataParallel model. Call "
            "mixprec.initialize(model, optimizer, ...) on the bare model, "
            "then mixprec.distributed.wrap_ddp(model, optimizer)."
        )
    if names & {"FSDPModule", "FullyShardedDataParallel"} and not m.__dict__.get("_mixprec_fsdp"):
        raise TypeError(
            f"initialize received an FSDP-sharded model ({type(m).__name__}). Use "
            "mixprec.distributed.initialize_fsdp(model, optimizer_fn, level, dtype), "
            "which shards with a matching MixedPrecisionPolicy."
        )


def _lean_level(props: dict[str, Any]) -> bool:
    """16-bit parameters without fp32 masters: where update modes (and their default) apply."""
    return bool(props["cast_params"] and not props["master_weights"])


def _refuse_mode_options(lean: dict[str, Any]) -> None:
    raise ValueError(
        f"{sorted(set(lean) - {'update'})} apply to an update mode; pass "
        "update='nearest', 'kahan' or 'stochastic' as well."
    )


def _sparse_grad_params(models: list[nn.Module]) -> set[int]:
    """ids of the weights that get sparse gradients: ``nn.Embedding(Bag)(sparse=True)``."""
    return {
        id(m.weight)
        for model in models
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }


def _default_update(
    optimizer: Optimizer, dtype: torch.dtype, sparse: set[int] | None = None
) -> str | None:
    """The ``update`` an optimizer gets without fp32 masters (O3) when none is given.

    ``"kahan"`` for bf16 with any optimizer, and for fp16 with an Adam-family optimizer
    (``betas`` in its defaults) or an ``eps`` that rounds to 0 in fp16; otherwise None (the
    optimizer's own 16-bit step). Update modes need dense gradients, so ``SparseAdam`` and an
    optimizer holding a parameter whose id is in ``sparse`` (a sparse embedding) get None.
    The module docstring gives the reasons.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(optimizer, torch.optim.SparseAdam) or any(
        id(p) in (sparse or ()) for p in params
    ):
        return None
    if dtype == torch.bfloat16:
        return "kahan"
    if dtype == torch.float16 and (
        "betas" in optimizer.defaults or _vanishing_eps([optimizer], dtype)
    ):
        return "kahan"
    return None


def _vanishing_eps(
    optimizers: list[Optimizer | None], dtype: torch.dtype
) -> tuple[int, float] | None:
    """``(optimizer index, eps)`` of the first ``eps`` that rounds to 0 in ``dtype``, or None.
    None entries (optimizers that need no check) are skipped."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # smallest subnormal
    for i, o in enumerate(optimizers):
        for group in [] if o is None else o.param_groups:
            eps = group.get("eps")
            if isinstance(eps, float) and 0 < eps < tiny:
                return i, eps
    return None


def _warn_vanishing_eps(optimizers: list[Optimizer | None], dtype: torch.dtype) -> None:
    """Without masters the optimizer's arithmetic runs in ``dtype``: an ``eps`` that rounds to 0
    there (Adam's 1e-8 in fp16) turns a zero gradient into 0/0 = NaN on the first step."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # smallest subnormal
    found = _vanishing_eps(optimizers, dtype)
    if found is not None:
        i, eps = found
        warnings.warn(
            f"Optimizer {i} has eps={eps:g}, which rounds to 0 in {dtype} (smallest positive "
            f"value {tiny:.3g}); without fp32 master weights its update can divide 0 by 0. Use "
            "update='kahan', master_weights=True (O2), or eps >= 1e-4.",
            RuntimeWarning,
            stacklevel=3,
        )


@torch.no_grad()
def fp32_state_dict(
    model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
) -> dict[str, Tensor]:
    """The model's state dict in float32 under its own keys, from the masters where they exist.

    It loads into a plain fp32 copy of the model (``load_state_dict``): the model is saved in
    fp32 whatever it trained in. With ``update="kahan"`` a weight's fp32 value is ``w + c`` (the
    16-bit weight plus its compensation buffer), moved one fp32 ulp toward ``w`` where ``w + c``
    lies exactly half-way between two 16-bit values (:func:`mixprec.core.resume.kahan_fp32`), so
    that loading it gives back ``w``; with the optimizer's state dict (loaded before or after
    ``initialize``) ``c`` comes back too, and a resume is bit for bit.
    """
    masters = {} if optimizer is None else {id(p): m for p, m in optimizer._pairs}
    lean = None if optimizer is None else getattr(optimizer, "lean", None)
    if lean is not None:
        masters.update({id(p): kahan_fp32(p, c) for p, c in lean.compensation.items()})
    for m in model.modules():
        for name, fp32 in m.__dict__.get(FROZEN_ATTR, {}).items():
            p = m._parameters.get(name)
            if p is not None:
                masters.setdefault(id(p), fp32)
    by_id = {id(p): p for p in model.parameters()}
    out: dict[str, Tensor] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for key, value in model.state_dict(keep_vars=True).items():
        source = named.get(key, value)
        source = masters.get(id(by_id.get(id(source), source)), source)
        t = source.detach()
        out[key] = (
            t.to(torch.float32).clone()
            if t.is_floating_point() and t.dtype != torch.float64
            else t.clone()
        )
    return out
