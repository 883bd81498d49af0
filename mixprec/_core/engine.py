"""The eager mixed-precision engine: ``mixprec.autocast`` regions and module boundaries.

A region is a ``torch.autocast`` region plus a frame on this thread's stack (:mod:`.dispatch`);
a module boundary (a per-module policy, the levels of ``initialize``) wraps the module's forward:
a frame, inputs cast on entry and outputs on exit.
Design: ``docs/design.md``, "The eager engine".
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from mixprec._core import _frames, regions
from mixprec._core._autocast_rules import cast_leaf, sync
from mixprec._core._frames import Frame
from mixprec._core._warnings import MixprecWarning
from mixprec._core.activations import ActivationConfig, SavedTensorStorage
from mixprec._core.cast_table import FP32_INSIDE_OPS
from mixprec._core.policy import (
    POLICY_ATTR,
    Policy,
    PolicyLike,
    as_policy,
    get_policy,
    global_policy,
)
from mixprec._core.widening import WideningStorage
from mixprec.fp8 import layers as fp8_layers

__all__ = [
    "FP32_INSIDE_OPS",
    "autocast",
    "cast_tree",
    "install_boundary",
    "is_active",
    "remove_boundary",
    "set_policy",
]

_LOW = (torch.float16, torch.bfloat16)
_KERNELS = ("auto", "torch")


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How a module boundary runs: its policy and the engine options for its subtree.

    Args:
        policy: compute dtype for the subtree and output dtype at its exit.
        cast_inputs: cast floating inputs to the compute dtype on entry.
        fp32_inside: let :data:`FP32_INSIDE_OPS` keep 16-bit inputs and outputs.
        kernels: see :class:`autocast`.
        cast_outputs: cast floating outputs to ``policy.output_dtype`` on exit.
        activations: how the subtree's saved tensors are stored (:mod:`mixprec._core.activations`).
        engine: run the subtree in an engine frame for ``policy``; False for a module whose casts
            are already explicit (a :func:`mixprec.convert` graph), which only needs the rest.
        widen: storage-only precision: the subtree's 16-bit weights, widened for their modules'
            forwards, are saved for backward as the parameters (:mod:`mixprec._core.widening`).
    """

    policy: Policy
    cast_inputs: bool = True
    fp32_inside: bool = False
    kernels: str = "auto"
    cast_outputs: bool = True
    activations: ActivationConfig | None = None
    engine: bool = True
    widen: bool = False


def cast_tree(obj: Any, dtype: torch.dtype, *, only_low: bool = False) -> Any:
    """Cast every floating tensor (not fp64) in a nested structure to ``dtype``; containers keep
    their type. With ``only_low`` only 16-bit tensors are cast (to widen inputs to float32)."""
    if isinstance(obj, torch.Tensor):
        return cast_leaf(obj, dtype, only_low)
    if isinstance(obj, (list, tuple)):
        items = [cast_tree(x, dtype, only_low=only_low) for x in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        try:  # list, tuple and their subclasses that take one iterable
            return type(obj)(items)
        except TypeError:
            return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        items = {k: cast_tree(v, dtype, only_low=only_low) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        out = copy.copy(obj)  # keep dict subclasses (OrderedDict, HF ModelOutput, defaultdict)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(obj, nn.Module):  # the module an unbound forward is called with
        return obj
    return _cast_node(obj, dtype, only_low)


def _cast_node(obj: Any, dtype: torch.dtype, only_low: bool) -> Any:
    """:func:`cast_tree` of a dataclass instance or another ``torch.utils._pytree`` node."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(
                    out, f.name, cast_tree(getattr(obj, f.name), dtype, only_low=only_low)
                )
        return out
    if type(obj) in _pytree.SUPPORTED_NODES:
        leaves, spec = _pytree.tree_flatten(obj)
        leaves = [cast_tree(x, dtype, only_low=only_low) for x in leaves]
        return _pytree.tree_unflatten(leaves, spec)
    return obj


def _frame_for(policy: Policy | None, kernels: str, fp32_inside: bool = False) -> Frame:
    if policy is None or not policy.is_lower:
        return Frame(None, kernels)
    return Frame(policy.compute_dtype, kernels, FP32_INSIDE_OPS if fp32_inside else frozenset())


class autocast:
    """Run the ops in a region under the cast table, in a 16-bit compute dtype.

    Args:
        recipe: ``torch.bfloat16``/``torch.float16``, any policy spelling, or a
            :class:`mixprec.Recipe` (its compute dtype and outputs, its ``kernels`` -- ``"auto"``
            swaps in mixprec's kernels where they were measured faster, see
            :mod:`mixprec._core.attention` -- and its ``fp8``: the Linears of the first module
            called in the region that the FP8 config chooses run their GEMMs in FP8 there,
            :mod:`mixprec.fp8`). None uses the global policy. A policy whose compute dtype is
            float32 disables the engine.
        enabled: False makes the region a no-op (control flow stays the same).
        cache_enabled: keep one 16-bit copy of each weight for the region (default True).

    Forward only: call ``backward`` outside the region (autograd replays the recorded casts).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> with autocast(torch.bfloat16):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(
        self, recipe: Any = None, *, enabled: bool = True, cache_enabled: bool = True
    ) -> None:
        region = getattr(recipe, "region_settings", None)  # a mixprec.Recipe
        if region is not None:
            policy, kernels, fp8 = region()
        else:
            policy = global_policy() if recipe is None else as_policy(recipe)
            kernels, fp8 = "auto", None
        if policy.compute_dtype not in (*_LOW, torch.float32, torch.float64):
            raise ValueError(f"autocast needs a floating compute dtype, received {policy}.")
        self.policy = policy
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.kernels = kernels
        self.fp8 = fp8
        self._stack: list[tuple[Frame, Any]] = []

    def __enter__(self) -> autocast:
        if self.enabled:
            if self.policy.is_lower and not torch.compiler.is_compiling():
                # (traced, it reads /proc/cpuinfo through a cached function: dynamo warns)
                from mixprec._core.hardware import warn_if_slow

                warn_if_slow(self.policy.compute_dtype)
            frame = _frame_for(self.policy, self.kernels)
            saved = regions.push(frame, cache_enabled=self.cache_enabled)
            self._stack.append((frame, saved))
            if self.fp8 is not None:
                fp8_layers.enter_region(self.fp8)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            if self.fp8 is not None:
                fp8_layers.exit_region()
            frame, saved = self._stack.pop()
            regions.pop(frame, saved)


def is_active() -> bool:
    """True inside a region where the engine lowers ops (a 16-bit frame is on top)."""
    frame = _frames.top()
    return frame is not None and frame.dtype is not None


# -- per-module policy boundaries ------------------------------------------------------------

BOUNDARY_ATTR = "_mixprec_boundary"


def _boundary(module: nn.Module) -> Boundary | None:
    spec = module.__dict__.get(BOUNDARY_ATTR)
    if spec is not None:
        return spec
    policy = get_policy(module)
    if policy is None:
        return None
    kernels, fp32_inside = _outer_setting()
    return Boundary(policy, kernels=kernels, fp32_inside=fp32_inside)


def _outer_setting() -> tuple[str, bool]:
    """The enclosing region's kernels and fp32-inside setting. A constant for dynamo: it runs
    this at trace time and installs no guard on the thread's stack, which holds trace-time
    frames then (a guard on them failed to build once the compilation had restored it)."""
    outer = _frames.top()
    return (outer.kernels, bool(outer.fp32_inside)) if outer else ("auto", False)


_outer_setting._dynamo_marked_constant = True  # torch.compiler.assume_constant_result's mark


class _Forward:
    """A module's forward with a boundary: its own forward inside the boundary's frame.

    A forward wrapper rather than forward hooks: under ``torch.compile(model)`` the root module's
    hooks are traced as frames of their own, whose autocast state changes do not survive
    compilation; the wrapper keeps the frame and the forward in one traced function. It keeps
    the wrapped forward's signature, pickles and deep-copies with its module.
    """

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module = module
        self.inner = inner  # an instance-level forward the module had, else None

    def _wrapped(self) -> Any:
        return (
            self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        )

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._wrapped())

    @property
    def __code__(self) -> Any:  # tools that read a forward's argument names (torch.export)
        return self._wrapped().__code__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        spec = _boundary(module)
        if self.inner is not None:
            forward = self.inner
        else:
            forward, args = type(module).forward, (module, *args)
        if spec is None:
            return forward(*args, **kwargs)
        if spec.activations is not None or spec.widen:
            return _run_with_storage(spec, forward, args, kwargs)
        return _run(spec, forward, args, kwargs)


def _traced_region(frame: Frame, forward: Any, args: tuple, kwargs: dict) -> Any:
    """``forward`` inside ``frame`` while dynamo traces it. torch.autocast's state comes from
    ``with torch.autocast(...)`` regions of the frame's setting, one per device type the frame
    sets: dynamo leaves those at a graph break and enters them again around the code at the
    break and the graph after it, where state set by hand would not outlive the first graph
    (AOTAutograd runs compiled graphs with autocast disabled). The frame itself is the
    graph node of :mod:`mixprec._core.traced`, which keeps it across a break."""
    dtype, on = frame.dtype or torch.bfloat16, frame.dtype is not None
    with torch.autocast("cpu", dtype=dtype, enabled=on):
        if "cuda" not in regions._devices():
            return _in_frame(frame, forward, args, kwargs)
        with torch.autocast("cuda", dtype=dtype, enabled=on):
            return _in_frame(frame, forward, args, kwargs)


def _in_frame(frame: Frame, forward: Any, args: tuple, kwargs: dict) -> Any:
    enter, exit_ = _frames._traced
    enter(frame.dtype, frame.kernels, bool(frame.fp32_inside), True)
    output = forward(*args, **kwargs)  # no try block: dynamo cannot resume a frame inside one
    exit_()
    return output


def _run(spec: Boundary, forward: Any, args: tuple, kwargs: dict) -> Any:
    """``forward`` inside the boundary ``spec``: inputs cast, engine frame, outputs cast."""
    if spec.cast_inputs:
        dtype = spec.policy.compute_dtype
        args, kwargs = cast_tree(args, dtype), cast_tree(kwargs, dtype)
    frame = _frame_for(spec.policy, spec.kernels, spec.fp32_inside) if spec.engine else None
    if frame is None:
        output = forward(*args, **kwargs)
    elif torch.compiler.is_dynamo_compiling() or torch.compiler.is_compiling():
        output = _compiled_region(frame, forward, args, kwargs)
    else:
        saved = regions.push(frame)
        try:
            output = forward(*args, **kwargs)
        finally:
            regions.pop(frame, saved)
    if output is None or not spec.cast_outputs:
        return output
    return cast_tree(output, spec.policy.output_dtype)


def _compiled_region(frame: Frame, forward: Any, args: tuple, kwargs: dict) -> Any:
    """``forward`` inside ``frame`` while torch.compile or torch.export traces it."""
    if (
        torch.compiler.is_dynamo_compiling()
        and not torch.compiler.is_exporting()  # export: push() records the casts
        and regions.ready_for_dynamo()
    ):
        return _traced_region(frame, forward, args, kwargs)
    saved = regions.push(frame)  # run eagerly (dynamo before torch 2.13; export)
    output = forward(*args, **kwargs)  # no try block: dynamo cannot resume a frame inside one
    regions.pop(frame, saved)
    return output


def _open_storage(spec: Boundary) -> Any:
    hooks: Any = None
    if spec.activations is not None:
        hooks = SavedTensorStorage(spec.activations, spec.policy.compute_dtype)
    if spec.widen:
        hooks = WideningStorage(hooks)
    hooks.__enter__()
    return hooks


def _close_storage(hooks: Any) -> None:
    hooks.__exit__(None, None, None)


def _with_storage(
    spec: Boundary, forward: Any, args: tuple, kwargs: dict, open_: Any, close: Any
) -> Any:
    """:func:`_run` under the boundary's saved-tensor storage hooks.

    dynamo does not trace saved-tensor hooks (entering them inside a compiled forward split the
    forward into several graphs), so under ``torch.compile`` this frame runs in Python (see
    :func:`_run_with_storage`): it enters the hooks and calls :func:`_run`, which dynamo
    compiles as a frame of its own -- the boundary and the whole forward in one graph, with the
    hooks active around it.
    """
    if _caller_hooks() is not None:
        # the caller's own hooks (torch.utils.checkpoint around the model, save_on_cpu, ...)
        # decide how this forward's tensors are saved; ours, innermost, would override them
        warnings.warn(
            "activations= is not applied to this forward: it runs inside other saved-tensor "
            "hooks (torch.utils.checkpoint around the model, save_on_cpu, ...), which decide "
            "how its tensors are saved.",
            MixprecWarning,
            stacklevel=5,
        )
        return _run(spec, forward, args, kwargs)
    hooks = open_(spec)
    try:
        return _run(spec, forward, args, kwargs)
    finally:
        close(hooks)


def _caller_hooks() -> Any:
    """The saved-tensor hooks active around this call (None: none, or a torch that cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


_untraced: dict[str, Any] = {}  # the above, kept out of dynamo's tracing (once it is loaded)


def _run_with_storage(spec: Boundary, forward: Any, args: tuple, kwargs: dict) -> Any:
    if "torch._dynamo" not in sys.modules:  # nothing can be compiling: don't import dynamo
        return _with_storage(spec, forward, args, kwargs, _open_storage, _close_storage)
    if not _untraced:
        disable = torch._dynamo.disable
        _untraced.update(
            run=disable(_with_storage, recursive=False),
            open=disable(_open_storage),
            close=disable(_close_storage),
        )
    return _untraced["run"](spec, forward, args, kwargs, _untraced["open"], _untraced["close"])


def has_boundary(module: nn.Module) -> bool:
    """True when :func:`install_boundary` was called on ``module``."""
    return isinstance(module.__dict__.get("forward"), _Forward)


def install_boundary(module: nn.Module) -> None:
    """Make ``module`` compute under its own policy (idempotent)."""
    if has_boundary(module):
        return
    regions.enable()  # mixprec's first use: its registrations with torch
    sync(first=True)  # now, not while a compiler traces the first forward
    module.__dict__["forward"] = _Forward(module, module.__dict__.get("forward"))


def remove_boundary(module: nn.Module) -> None:
    """Undo :func:`install_boundary`, if it was called."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _Forward):
        if wrapper.inner is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = wrapper.inner


def set_policy(module: nn.Module, policy: PolicyLike | None) -> nn.Module:
    """Attach ``policy`` to ``module``; it wins over the global policy for the whole subtree.

    The module then computes in ``policy.compute_dtype``: its floating inputs are cast on entry
    and its outputs to ``policy.output_dtype`` on exit, inside or outside a
    ``mixprec.autocast`` region. ``Policy("float32")`` keeps a subtree in full precision.
    Storage (``param_dtype``) is applied by :func:`mixprec.initialize`. ``None`` removes it.

    Returns:
        The module, for chaining.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_policy expects an nn.Module, received {type(module).__name__}.")
    if policy is None:
        if hasattr(module, POLICY_ATTR):
            delattr(module, POLICY_ATTR)
        remove_boundary(module)
        return module
    object.__setattr__(module, POLICY_ATTR, as_policy(policy))
    install_boundary(module)
    return module
