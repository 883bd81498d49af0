"""The eager mixed-precision engine: ``with mixprec.autocast(torch.bfloat16): ...``.

Mechanism -- a ``TorchFunctionMode`` on top of ``torch.autocast`` (chosen by measurement, see
``benchmarks/NOTES.md``):

* The mode sees every torch function, ``torch.nn.functional`` function and Tensor method called
  from Python and applies the cast table (:mod:`mixprec.cast_table`) to it: ``lower`` ops get
  16-bit inputs, ``fp32`` ops get float32 inputs and run with torch.autocast switched off,
  ``promote`` ops get their inputs widened. The casts are ordinary differentiable ``.to()``
  calls recorded by autograd, so backward needs no help and input gradients come back in the
  inputs' own dtypes.
* ``torch.autocast`` stays on underneath, with its own cache off. It only matters inside opaque
  Python composites (e.g. ``F.multi_head_attention_forward``) whose inner calls a function mode
  cannot see: their matmuls are still lowered there.
* Cost: a dict lookup per Python-level op call -- a few microseconds per op, well under 1% of a
  transformer step -- measured against torch.autocast in ``benchmarks/bench_step.py``.

The cast cache holds the 16-bit copy of each leaf tensor that requires grad (the weights) for
the lifetime of the outermost region. An entry is keyed by the tensor's identity *and* version
counter, so an in-place optimizer step inside the region invalidates it (torch.autocast would
serve the stale copy); an entry built under ``no_grad`` is never handed to a grad-enabled
forward. There is at most one entry per (weight, dtype): repeated ``no_grad`` forwards do not
grow it.

fp64 and integer tensors pass through, in-place ops and ``out=`` calls are never downcast, and
ops given an explicit ``dtype=`` keep it.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec import kernels
from mixprec.cast_table import FP32, LOWER, PROMOTE, _effective, resolve_op
from mixprec.policy import Policy, PolicyLike, as_policy, get_policy, global_policy

__all__ = ["autocast", "is_active", "cache_size", "install_boundary", "remove_boundary",
           "cast_tree"]

_LOW = (torch.float16, torch.bfloat16)
_KERNELS = ("auto", "torch")

# fp32-rule ops whose 16-bit kernels accumulate in float32 internally (CPU and CUDA): with
# ``fp32_inside`` they keep 16-bit inputs and outputs -- the seed's "memory-bound ops stay
# 16-bit in and out, compute in fp32 inside" -- instead of paying for two casts.
# The ATen spellings are listed too: the graph pass (mixprec.graph.paint) reads this set.
FP32_INSIDE_OPS = frozenset({"layer_norm", "group_norm", "softmax", "log_softmax",
                             "native_layer_norm", "native_group_norm", "_softmax",
                             "_log_softmax"})


@dataclass(frozen=True)
class _Frame:
    dtype: torch.dtype | None  # None: the engine passes everything through
    kernels: str = "auto"
    fp32_inside: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Boundary:
    """How a module boundary runs: its policy and the engine options for its subtree.

    Args:
        policy: compute dtype for the subtree and output dtype at its exit.
        cast_inputs: cast floating inputs to the compute dtype on entry.
        fp32_inside: let :data:`FP32_INSIDE_OPS` keep 16-bit inputs and outputs.
        kernels: see :class:`autocast`.
        cast_outputs: cast floating outputs to ``policy.output_dtype`` on exit.
    """

    policy: Policy
    cast_inputs: bool = True
    fp32_inside: bool = False
    kernels: str = "auto"
    cast_outputs: bool = True


class _State(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.cache: dict[tuple[int, torch.dtype], tuple[Any, int, torch.Tensor, bool]] = {}
        self.cache_enabled = True
        self.torch_cache_enabled = True
        self.mode: _Mode | None = None
        # module boundaries entered by this thread: id(module) -> [(frame, saved, spec)]; kept
        # per thread so that threads sharing a model do not pop each other's frames
        self.boundaries: dict[int, list[tuple[_Frame, list, Boundary]]] = {}


_state = _State()


@functools.lru_cache(maxsize=1)
def _devices() -> tuple[str, ...]:
    """Device types whose torch.autocast state the engine manages (asked once: hot path)."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype:
        return t
    if not (_state.cache_enabled and _state.frames and t.is_leaf and t.requires_grad
            and dtype in _LOW):
        return t.to(dtype)
    grad = torch.is_grad_enabled()
    key = (id(t), dtype)
    entry = _state.cache.get(key)
    if entry is not None:
        ref, version, cast, with_grad = entry
        if ref() is t and version == t._version and (with_grad or not grad):
            return cast
    cast = t.to(dtype)
    _state.cache[key] = (weakref.ref(t), t._version, cast, grad)
    return cast


def cast_tree(obj: Any, dtype: torch.dtype, *, only_low: bool = False) -> Any:
    """Cast every floating tensor (not fp64) in a nested list/tuple/dict structure to ``dtype``.

    With ``only_low`` only 16-bit tensors are cast (used to widen inputs to float32).
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != torch.float64 and obj.dtype != dtype and (
                not only_low or obj.dtype in _LOW):
            return _cast_tensor(obj, dtype)
        return obj
    if isinstance(obj, (list, tuple)):
        items = [cast_tree(x, dtype, only_low=only_low) for x in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items) if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        items = {k: cast_tree(v, dtype, only_low=only_low) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        out = copy.copy(obj)  # keep dict subclasses (OrderedDict, HF ModelOutput, defaultdict)
        for k, v in items.items():
            out[k] = v
        return out
    return obj


def _float_dtypes(obj: Any, found: set[torch.dtype]) -> set[torch.dtype]:
    """Add the dtypes of the floating tensors in ``obj`` (nested lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            found.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _float_dtypes(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _float_dtypes(x, found)
    return found


class _AutocastOff:
    """Switch torch.autocast off for one call (fp32-rule ops) and restore it after."""

    __slots__ = ("saved",)

    def __enter__(self) -> None:
        self.saved = [(d, torch.is_autocast_enabled(d)) for d in _devices()]
        for d, _ in self.saved:
            torch.set_autocast_enabled(d, False)

    def __exit__(self, *exc: Any) -> None:
        for d, on in self.saved:
            torch.set_autocast_enabled(d, on)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        frame = _state.frames[-1] if _state.frames else None
        if frame is None or frame.dtype is None:
            return func(*args, **kwargs)
        name, inplace = resolve_op(func)
        if inplace or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        table, opted_out = _effective()
        rule = table.get(name)
        if rule is None:
            if name in opted_out:  # register_op(op, None): input dtype, torch.autocast too
                with _AutocastOff():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if rule == LOWER:
            args = cast_tree(args, frame.dtype)
            kwargs = cast_tree(kwargs, frame.dtype) if kwargs else kwargs
            if name == "scaled_dot_product_attention" and frame.kernels == "auto":
                out = kernels.try_decomposed_attention(args, kwargs)
                if out is not None:
                    return out
            return func(*args, **kwargs)
        if rule == FP32:
            if kwargs.get("dtype") is not None:
                return func(*args, **kwargs)
            if name in frame.fp32_inside and args and isinstance(args[0], torch.Tensor) \
                    and args[0].dtype in _LOW:
                args = (args[0], *cast_tree(args[1:], args[0].dtype))
                with _AutocastOff():
                    return func(*args, **kwargs)
            args = cast_tree(args, torch.float32, only_low=True)
            kwargs = cast_tree(kwargs, torch.float32, only_low=True) if kwargs else kwargs
            with _AutocastOff():
                return func(*args, **kwargs)
        if rule == PROMOTE:
            found: set[torch.dtype] = set()
            _float_dtypes(args, found)
            _float_dtypes(kwargs, found)
            if len(found) > 1 and torch.float64 not in found:
                args = cast_tree(args, torch.float32, only_low=True)
                kwargs = cast_tree(kwargs, torch.float32, only_low=True) if kwargs else kwargs
            with _AutocastOff():  # promoted here; torch.autocast's own promotion rejects
                return func(*args, **kwargs)  # e.g. float16 inputs in a bfloat16 region
        return func(*args, **kwargs)


def _push(frame: _Frame) -> list[tuple[str, bool, torch.dtype]]:
    """Push ``frame``; return the torch.autocast state to restore on pop."""
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _devices()]
    if not _state.frames:
        _state.torch_cache_enabled = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        _state.mode = _Mode()
        _state.mode.__enter__()
    _state.frames.append(frame)
    torch.autocast_increment_nesting()
    for d, _, _ in saved:
        if frame.dtype is None:
            torch.set_autocast_enabled(d, False)
        else:
            torch.set_autocast_dtype(d, frame.dtype)
            torch.set_autocast_enabled(d, True)
    return saved


def _pop(frame: _Frame, saved: list[tuple[str, bool, torch.dtype]]) -> None:
    if not _state.frames or _state.frames[-1] is not frame:
        raise RuntimeError("mixprec.autocast regions were exited out of order.")
    _state.frames.pop()
    torch.autocast_decrement_nesting()
    for d, on, dt in saved:
        torch.set_autocast_dtype(d, dt)
        torch.set_autocast_enabled(d, on)
    if not _state.frames:
        mode, _state.mode = _state.mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        _state.cache.clear()
        torch.set_autocast_cache_enabled(_state.torch_cache_enabled)


def _frame_for(policy: Policy | None, kernels: str, fp32_inside: bool = False) -> _Frame:
    if policy is None or not policy.is_lower:
        return _Frame(None, kernels)
    return _Frame(policy.compute_dtype, kernels, FP32_INSIDE_OPS if fp32_inside else frozenset())


class autocast:
    """Run the ops in a region under the cast table, in a 16-bit compute dtype.

    Args:
        dtype_or_policy: ``torch.bfloat16``/``torch.float16``, or any policy spelling; None
            uses the global policy. A policy whose compute dtype is float32 disables the engine.
        enabled: False makes the region a no-op (control flow stays the same).
        cache_enabled: keep one 16-bit copy of each weight for the region (default True).
        kernels: ``"auto"`` (default) swaps in mixprec's kernels where they were measured
            faster -- today the decomposed attention for CPU bfloat16 training, see
            :mod:`mixprec.kernels`; ``"torch"`` always runs torch's own kernels.

    Forward only: call ``backward`` outside the region (autograd replays the recorded casts).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> with autocast(torch.bfloat16):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, dtype_or_policy: PolicyLike | None = None, *, enabled: bool = True,
                 cache_enabled: bool = True, kernels: str = "auto"):
        if kernels not in _KERNELS:
            raise ValueError(f"kernels={kernels!r} is not one of {_KERNELS}.")
        policy = global_policy() if dtype_or_policy is None else as_policy(dtype_or_policy)
        if policy.compute_dtype not in _LOW + (torch.float32, torch.float64):
            raise ValueError(f"autocast needs a floating compute dtype, received {policy}.")
        self.policy = policy
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.kernels = kernels
        self._stack: list[tuple[_Frame, list, bool]] = []

    def __enter__(self) -> autocast:
        if self.enabled:
            if self.policy.is_lower:
                from mixprec.hardware import warn_if_slow

                warn_if_slow(self.policy.compute_dtype)
            frame = _frame_for(self.policy, self.kernels)
            previous_cache = _state.cache_enabled
            saved = _push(frame)
            _state.cache_enabled = self.cache_enabled and previous_cache
            self._stack.append((frame, saved, previous_cache))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            frame, saved, previous_cache = self._stack.pop()
            _state.cache_enabled = previous_cache
            _pop(frame, saved)


def is_active() -> bool:
    """True inside a region where the engine lowers ops (a 16-bit frame is on top)."""
    return bool(_state.frames) and _state.frames[-1].dtype is not None


def cache_size() -> int:
    """Number of weight casts currently cached (for tests and diagnostics)."""
    return len(_state.cache)


# -- per-module policy boundaries ------------------------------------------------------------

_HOOKS = "_mixprec_boundary_hooks"
BOUNDARY_ATTR = "_mixprec_boundary"


def _boundary(module: nn.Module) -> Boundary | None:
    spec = module.__dict__.get(BOUNDARY_ATTR)
    if spec is not None:
        return spec
    policy = get_policy(module)
    if policy is None:
        return None
    outer = _state.frames[-1] if _state.frames else None
    return Boundary(policy, kernels=outer.kernels if outer else "auto",
                    fp32_inside=bool(outer and outer.fp32_inside))


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    spec = _boundary(module)
    if spec is None:
        return args, kwargs
    frame = _frame_for(spec.policy, spec.kernels, spec.fp32_inside)
    saved = _push(frame)
    _state.boundaries.setdefault(id(module), []).append((frame, saved, spec))
    if not spec.cast_inputs:
        return args, kwargs
    dtype = spec.policy.compute_dtype
    return cast_tree(args, dtype), cast_tree(kwargs, dtype)


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    stack = _state.boundaries.get(id(module))
    if not stack:
        return output
    frame, saved, spec = stack.pop()
    if not stack:
        del _state.boundaries[id(module)]
    _pop(frame, saved)
    if output is None or not spec.cast_outputs:
        return output
    return cast_tree(output, spec.policy.output_dtype)


def install_boundary(module: nn.Module) -> None:
    """Install the hooks that make ``module`` compute under its own policy (idempotent)."""
    if _HOOKS in module.__dict__:
        return
    handles = (module.register_forward_pre_hook(_pre_hook, with_kwargs=True, prepend=True),
               module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True))
    module.__dict__[_HOOKS] = handles


def remove_boundary(module: nn.Module) -> None:
    """Remove the hooks installed by :func:`install_boundary`, if any."""
    for handle in module.__dict__.pop(_HOOKS, ()):
        handle.remove()
