"""``mixprec.for_inference``: a trained model turned into an eval-mode mixed-precision model.

Design (the deployment half of the Apex O2 recipe and the Keras policy rule that "mixed"
models return float32; ``docs/design.md``, "Inference and export"):

* **Storage follows the cast table, not a list of layer types.** A parameter or buffer is stored
  in the 16-bit compute dtype unless it must stay float32: it belongs to a normalization layer
  (statistics and affine parameters, as at O2), to a subtree whose ``set_policy`` keeps float32,
  to a module named in ``keep_fp32``, or -- when ``example_inputs`` are given -- one trace shows
  that it is consumed directly by an op whose rule is ``"fp32"`` (a hand-written RMSNorm's
  weight, a temperature fed to ``exp``). One fp32 forward under a ``TorchFunctionMode`` finds
  those consumers; without example inputs the module rule alone applies (O2's rule).
* **No training state.** The result is a deep copy (the caller's model is not touched), in eval
  mode, with ``requires_grad`` off, no fp32 master weights and no loss scaler. Weights come from
  the fp32 masters when the ``initialize`` optimizer is passed, from an ``fp32_state_dict``
  checkpoint when given, else from the model itself.
* **Compute runs under the same eager engine as training** (one ``engine.Boundary`` at the
  root: inputs cast at entry, ``fp32_inside`` norms/softmax, float32 outputs), so inference
  numerics match what the model was trained with. ``engine="graph"`` hands the model to the
  graph-rewrite pass ``mixprec.convert`` instead, where that pass exists.
* **int8 mixing** is delegated to :mod:`mixprec.inference.quantize` (``int8=`` option).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from mixprec._core import engine
from mixprec._core.cast_table import FP32, resolve_op, rule_for
from mixprec._core.fp32_values import fp32_state_dict
from mixprec._core.hardware import default_dtype
from mixprec._core.norms import is_norm
from mixprec._core.policy import Policy, as_policy, get_policy
from mixprec._initialize import _MARK
from mixprec.inference.inputs import call_model

__all__ = [
    "INFERENCE_ATTR",
    "InferenceInfo",
    "for_inference",
    "inference_info",
    "storage_plan",
    "strip_engine",
    "to_fp32_twin",
]

INFERENCE_ATTR = "_mixprec_inference"
_LOW = (torch.float16, torch.bfloat16)


@dataclass
class InferenceInfo:
    """What :func:`for_inference` did to a model (stored on the returned model).

    Attributes:
        policy: the policy the model computes under.
        storage: ``{state-dict key: dtype}`` of every floating parameter and buffer.
        fp32_reasons: ``{key: why it stays float32}`` for the floating entries kept in fp32.
        int8: ``{module name: int8 mode}`` of the modules stored as int8.
        engine: ``"eager"`` or ``"graph"``.
    """

    policy: Policy
    storage: dict[str, torch.dtype]
    fp32_reasons: dict[str, str]
    int8: dict[str, str] = field(default_factory=dict)
    engine: str = "eager"

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return self.policy.compute_dtype


def inference_info(model: nn.Module) -> InferenceInfo | None:
    """The :class:`InferenceInfo` of a model returned by :func:`for_inference`, else None."""
    return model.__dict__.get(INFERENCE_ATTR)


def strip_engine(model: nn.Module) -> nn.Module:
    """Remove mixprec's engine boundaries and ``initialize`` marks from ``model`` (in place)."""
    for m in model.modules():
        engine.remove_boundary(m)
        for attr in (engine.BOUNDARY_ATTR, _MARK, INFERENCE_ATTR):
            m.__dict__.pop(attr, None)
    return model


def to_fp32_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every floating tensor in float32 and no mixprec hooks.

    16-bit values widen exactly, so re-narrowing the twin's weights reproduces the model's.
    Per-module ``set_policy`` attributes are dropped too: the twin is a plain fp32 module.
    """
    twin = strip_engine(copy.deepcopy(model))
    for m in twin.modules():
        if get_policy(m) is not None:
            m.__dict__.pop("_mixprec_policy", None)
    _cast(twin, {}, torch.float32)
    return twin


def _cast(model: nn.Module, plan: Mapping[str, torch.dtype], default: torch.dtype) -> None:
    for prefix, m in model.named_modules():
        dot = prefix + "." if prefix else ""
        for name, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float64:
                p.data = p.data.to(plan.get(dot + name, default))
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != torch.float64:
                m._buffers[name] = b.to(plan.get(dot + name, default))


class _ConsumerTrace(TorchFunctionMode):
    """Records, for each tensor id, the rules of the ops that take it directly as an input."""

    def __init__(self, watched: dict[int, str]):
        super().__init__()
        self.watched = watched
        self.fp32_ops: dict[str, str] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name, inplace = resolve_op(func)
        if not inplace and name and rule_for(name) == FP32:
            for a in (*args, *kwargs.values()):
                key = self.watched.get(id(a)) if isinstance(a, Tensor) else None
                if key is not None:
                    self.fp32_ops.setdefault(key, name)
        return func(*args, **kwargs)


def storage_plan(
    model: nn.Module,
    dtype: torch.dtype,
    example_inputs: Any = None,
    *,
    keep_fp32: Iterable[str | type] = (),
) -> tuple[dict[str, torch.dtype], dict[str, str]]:
    """The storage dtype of every floating parameter/buffer of an fp32 ``model``.

    Args:
        model: a float32 module (it is run once, under ``no_grad``, if inputs are given).
        dtype: the 16-bit compute dtype (float32 gives an all-fp32 plan).
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs;
            when given, tensors consumed directly by ``"fp32"``-rule ops stay float32.
        keep_fp32: module names (``"head"``, ``"blocks.0.ln1"``) or module types kept in fp32.

    Returns:
        ``(plan, reasons)``: ``{key: dtype}`` and ``{key: reason}`` for the fp32 entries.
    """
    keep = list(keep_fp32)
    names = dict(model.named_modules())
    for k in keep:
        if isinstance(k, str) and k not in names:
            raise ValueError(
                f"keep_fp32 names module {k!r}, which the model does not have; "
                f"modules are e.g. {list(names)[1:6]}."
            )
        if not isinstance(k, (str, type)):
            raise TypeError(f"keep_fp32 takes module names or types, received {k!r}.")
    plan: dict[str, torch.dtype] = {}
    reasons: dict[str, str] = {}

    def visit(prefix: str, m: nn.Module, inherited: str | None) -> None:
        why = inherited
        pol = get_policy(m)
        if pol is not None:
            why = None if pol.param_dtype in _LOW else f"set_policy({pol.name}) on {prefix!r}"
        if is_norm(m):
            why = f"normalization layer {type(m).__name__}"
        if prefix in keep or any(isinstance(k, type) and isinstance(m, k) for k in keep):
            why = f"keep_fp32 ({prefix or type(m).__name__})"
        dot = prefix + "." if prefix else ""
        tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        for name, t in tensors:
            if t is None or not t.is_floating_point() or t.dtype == torch.float64:
                continue
            if dtype not in _LOW:
                plan[dot + name] = torch.float32
                continue
            plan[dot + name] = torch.float32 if why else dtype
            if why:
                reasons[dot + name] = why
        for child_name, child in m.named_children():
            visit(dot + child_name, child, why)

    visit("", model, None)
    if example_inputs is not None and dtype in _LOW:
        watched = {
            id(t): k
            for k, t in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
            if k in plan
        }
        trace = _ConsumerTrace(watched)
        with torch.no_grad(), trace:
            call_model(model, example_inputs)
        for key, op in trace.fp32_ops.items():
            if plan[key] != torch.float32:
                plan[key] = torch.float32
                reasons[key] = f"consumed by fp32-rule op {op!r}"
    return plan, reasons


def _load_checkpoint(checkpoint: Any) -> Mapping[str, Tensor]:
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, Mapping):
        raise TypeError(
            "checkpoint must be a state dict (e.g. from mixprec.fp32_state_dict) or "
            f"a path to one saved with torch.save, received "
            f"{type(checkpoint).__name__}."
        )
    return checkpoint


def for_inference(
    model: nn.Module,
    recipe: Any = None,
    example_inputs: Any = None,
    *,
    checkpoint: Any = None,
    optimizer: Any = None,
    keep_fp32: Any = (),
    int8: str | None = None,
    int8_modules: Any = "auto",
    int8_tolerance: float = 1e-3,
    int8_metric: Any = None,
    engine: str = "eager",
) -> nn.Module:
    """An eval-mode copy of ``model`` whose weights are stored and computed in 16-bit.

    Args:
        model: a plain fp32 module, a module returned by :func:`mixprec.initialize`, or a fresh
            module to load ``checkpoint`` into. It is not modified.
        recipe: a :class:`mixprec.Recipe` (its dtype stores and computes the weights, its
            ``outputs`` is the outputs' dtype) or any policy spelling (``"mixed_bfloat16"``,
            ``torch.float16``, ...: its compute dtype stores and computes; a bare dtype returns
            float32). None uses :func:`mixprec.default_dtype` for the model's device. A
            float32 policy gives an fp32 eval copy (the baseline).
        example_inputs: inputs for one fp32 trace (tensor, tuple or dict of kwargs) that keeps
            float32 every tensor an ``"fp32"``-rule op consumes, and that int8 selection uses.
        checkpoint: a state dict (``mixprec.fp32_state_dict``) or a path, loaded strictly.
        optimizer: the ``initialize`` optimizer; its fp32 master weights are used.
        keep_fp32: module names or types to keep in float32.
        int8: None, ``"dynamic"`` (torch int8 GEMM, CPU) or ``"weight_only"`` (portable,
            exportable); see :func:`mixprec.inference.quantize.quantize_int8`.
        int8_modules: ``"auto"`` (accuracy-driven choice, needs ``example_inputs``) or a
            list of Linear/Conv module names.
        int8_tolerance: error budget for ``"auto"`` (1 - cosine similarity).
        int8_metric: optional ``f(output, reference) -> error`` for ``"auto"``.
        engine: ``"eager"`` or ``"graph"`` (``mixprec.convert``).

    Returns:
        The new model; :func:`inference_info` describes its storage.

    Example:
        >>> fast = for_inference(torch.nn.Linear(4, 2), "mixed_bfloat16")  # doctest: +SKIP
    """
    options = dict(
        checkpoint=checkpoint,
        optimizer=optimizer,
        keep_fp32=keep_fp32,
        int8=int8,
        int8_modules=int8_modules,
        int8_tolerance=int8_tolerance,
        int8_metric=int8_metric,
    )
    if not isinstance(model, nn.Module):
        hint = (
            " To build from a checkpoint, pass a fresh model and checkpoint=state_dict."
            if isinstance(model, Mapping)
            else ""
        )
        raise TypeError(
            f"for_inference expects an nn.Module, received {type(model).__name__}." + hint
        )
    pol = _inference_policy(model, recipe)
    if engine not in ("eager", "graph"):
        raise ValueError(f"engine must be 'eager' or 'graph', received {engine!r}.")
    return _for_inference(model, pol, example_inputs, engine, options)


def _inference_policy(model: nn.Module, spec: Any) -> Policy:
    """Weights stored in the compute dtype; outputs in the recipe's or policy's output dtype
    (float32 for a bare dtype)."""
    from mixprec.recipe import level_recipe

    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    recipe = level_recipe(spec)  # Lightning's names are read as policies below
    if recipe is not None:
        dtype = recipe.resolved_dtype(device)
        return Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=recipe.outputs or dtype)
    if spec is None:
        dtype = default_dtype(device)
        return Policy(param_dtype=dtype, compute_dtype=dtype)
    pol = as_policy(spec)  # a bare dtype means "compute in it, return float32"
    return Policy(
        param_dtype=pol.compute_dtype,
        compute_dtype=pol.compute_dtype,
        output_dtype=torch.float32 if isinstance(spec, torch.dtype) else pol.output_dtype,
    )


def _for_inference(
    model: nn.Module, pol: Policy, example_inputs: Any, mode: str, options: dict[str, Any]
) -> nn.Module:
    """The body of :func:`for_inference`, its arguments checked."""
    dtype = pol.compute_dtype
    policies = {name: get_policy(m) for name, m in model.named_modules() if get_policy(m)}
    out = _fp32_copy(model, policies, options)
    plan, reasons = storage_plan(out, dtype, example_inputs, keep_fp32=options.get("keep_fp32", ()))
    reference = None
    int8 = options.get("int8")
    if int8 is not None and options.get("int8_modules", "auto") == "auto":
        if example_inputs is None:
            raise ValueError(
                "int8_modules='auto' chooses modules by accuracy and needs "
                "example_inputs; pass them or list the modules explicitly."
            )
        with torch.no_grad():
            reference = call_model(out, example_inputs)
    if mode == "graph":  # the graph pass owns casts and storage: hand it the fp32 model
        out = _graph_convert(out, pol, example_inputs)
        plan = {k: t.dtype for k, t in out.state_dict().items() if t.is_floating_point()}
    else:
        _cast(out, plan, dtype)
    _install_boundaries(out, pol, policies, mode)
    info = InferenceInfo(
        pol, plan, {k: v for k, v in reasons.items() if plan.get(k) == torch.float32}, engine=mode
    )
    out.__dict__[INFERENCE_ATTR] = info
    if int8 is not None:
        from mixprec.inference.quantize import quantize_int8

        out, chosen = quantize_int8(
            out,
            options["int8_modules"],
            mode=int8,
            example_inputs=example_inputs,
            reference=reference,
            tolerance=options.get("int8_tolerance", 1e-3),
            metric=options.get("int8_metric"),
        )
        info.int8 = dict.fromkeys(chosen, int8)
        out.__dict__[INFERENCE_ATTR] = info
    return out


def _fp32_copy(model: nn.Module, policies: dict[str, Policy], options: dict[str, Any]) -> nn.Module:
    """The eval-mode fp32 twin of ``model`` with its per-module policies, holding the weights
    of ``optimizer=``'s masters or of ``checkpoint=`` when given (loaded strictly)."""
    state: Mapping[str, Tensor] | None = None
    if options.get("optimizer") is not None:
        state = fp32_state_dict(model, options["optimizer"])
    out = to_fp32_twin(model)
    for name, m in out.named_modules():
        if name in policies:
            object.__setattr__(m, "_mixprec_policy", policies[name])
    if options.get("checkpoint") is not None:
        if state is not None:
            raise ValueError("Give checkpoint= or optimizer=, not both: both supply the weights.")
        state = _load_checkpoint(options["checkpoint"])
    if state is not None:
        try:
            out.load_state_dict(
                {
                    k: v.float() if v.is_floating_point() and v.dtype != torch.float64 else v
                    for k, v in state.items()
                }
            )
        except RuntimeError as e:
            raise ValueError(
                f"The checkpoint does not fit this model ({type(model).__name__}): "
                f"{str(e).splitlines()[0]} ..."
            ) from e
    out.eval().requires_grad_(False)
    return out


def _install_boundaries(
    out: nn.Module, pol: Policy, policies: dict[str, Policy], mode: str
) -> None:
    """The engine's boundary on each module that had a policy and, in eager mode with a 16-bit
    policy, on the model itself (inputs cast in, outputs cast out)."""
    for name, m in out.named_modules():
        if name in policies:
            engine.install_boundary(m)
    if mode == "eager" and pol.compute_dtype in _LOW:
        spec = engine.Boundary(
            pol, cast_inputs=True, fp32_inside=True, kernels="auto", cast_outputs=True
        )
        out.__dict__[engine.BOUNDARY_ATTR] = spec
        engine.install_boundary(out)


def _graph_convert(model: nn.Module, policy: Policy, example_inputs: Any) -> nn.Module:
    from mixprec.graph.convert import convert  # the graph pass sits beside this tool

    if example_inputs is None:
        raise ValueError("engine='graph' traces the model and needs example_inputs.")
    if isinstance(example_inputs, Mapping):
        return convert(model, (), policy, example_kwargs=dict(example_inputs))
    return convert(model, example_inputs, policy)
