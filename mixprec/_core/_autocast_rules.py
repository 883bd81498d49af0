"""mixprec's autocast kernels: the cast table's rules on torch's autocast dispatch keys.

Design (``docs/design.md``, "The eager engine"): a mixprec region *is* a ``torch.autocast``
region, plus Python kernels registered with ``torch.library`` on the ``AutocastCPU`` /
``AutocastCUDA`` keys for exactly the ops whose cast-table rule differs from torch's on that
device (:mod:`mixprec._core.torch_lists`). :func:`sync` registers them at mixprec's first use,
never at import, and again when the cast table changes. A kernel applies mixprec's rule only
under a mixprec frame (:mod:`mixprec._core._frames`); elsewhere it does what torch does.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.overrides import TorchFunctionMode

from mixprec._core import attention, cast_table
from mixprec._core._frames import Frame, _frame_for_kernel, _state, top
from mixprec._core.cast_table import FP32, FP32_INSIDE_OPS, LOWER, NATIVE_PROMOTE, PROMOTE
from mixprec._core.torch_lists import TORCH_AUTOCAST, torch_rule

__all__ = [
    "FP32_INSIDE_OPS",
    "NATIVE_PROMOTE",
    "apply_rule",
    "cast_leaf",
    "float_dtypes",
    "needs_kernel",
    "registered",
    "sync",
]

_LOW = (torch.float16, torch.bfloat16)


# in-place ops that update weights (optimizers, EMA, manual SGD, load_state_dict, init)
_INPLACE_UPDATES = (
    "add_",
    "sub_",
    "mul_",
    "div_",
    "copy_",
    "lerp_",
    "addcmul_",
    "addcdiv_",
    "zero_",
    "fill_",
    "clamp_",
    "normal_",
    "uniform_",
    "set_",
)

_KEYS = {"cpu": DispatchKey.AutocastCPU, "cuda": DispatchKey.AutocastCUDA}

# -- casts ------------------------------------------------------------------------------------


def cast_leaf(t: torch.Tensor, dtype: torch.dtype, only_low: bool = False) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating and not fp64 (with ``only_low``: only if 16-bit)."""
    if (
        t.is_floating_point()
        and t.dtype != dtype
        and t.dtype != torch.float64
        and (not only_low or t.dtype in _LOW)
    ):
        return t.to(dtype)
    return t


def _cast(obj: Any, dtype: torch.dtype, only_low: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return cast_leaf(obj, dtype, only_low)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(x, dtype, only_low) for x in obj)
    return obj


def _cast_all(
    args: tuple, kwargs: dict, dtype: torch.dtype, only_low: bool = False
) -> tuple[tuple, dict]:
    return (
        tuple(_cast(a, dtype, only_low) for a in args),
        {k: _cast(v, dtype, only_low) for k, v in kwargs.items()} if kwargs else kwargs,
    )


def float_dtypes(obj: Any, found: set) -> set:
    """Add the dtypes of the floating tensors in ``obj`` (nested lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            found.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            float_dtypes(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            float_dtypes(x, found)
    return found


def _has_dtype_arg(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


# -- kernels ----------------------------------------------------------------------------------


def apply_rule(
    rule: str | None,
    name: str,
    frame: Frame | None,
    low: torch.dtype,
    args: tuple,
    kwargs: dict,
    op: Callable,
) -> Any:
    """Run ``op`` under ``rule`` (the cast table's rules, torch's ``"banned"``, or ``"input"``);
    ``low`` is the dtype of ``"lower"``, and ``frame`` None means torch.autocast's semantics."""
    if rule == LOWER:
        return _lower(name, frame, low, args, kwargs, op)
    if rule == FP32:
        return _fp32(name, frame, args, kwargs, op)
    if rule == PROMOTE:
        return _promote(frame, args, kwargs, op)
    if rule == "banned":
        raise RuntimeError(
            f"torch.autocast refuses {name} (unsafe to autocast); use its *_with_logits form, "
            "or run it under mixprec.autocast, which computes it in float32."
        )
    return op(*args, **kwargs)  # "input": run in the inputs' dtype


def _lower(
    name: str, frame: Frame | None, low: torch.dtype, args: tuple, kwargs: dict, op: Callable
) -> Any:
    args, kwargs = _cast_all(args, kwargs, low)
    if frame is not None and frame.kernels == "auto" and name == "scaled_dot_product_attention":
        out = attention.try_decomposed_attention(args, kwargs)
        if out is not None:
            return out
    return op(*args, **kwargs)


def _fp32(name: str, frame: Frame | None, args: tuple, kwargs: dict, op: Callable) -> Any:
    """fp32 inputs, except an explicit ``dtype=`` and a 16-bit input of an ``fp32_inside`` op
    (its kernel accumulates in fp32: the other arguments follow the first one's dtype)."""
    if _has_dtype_arg(args, kwargs):
        return op(*args, **kwargs)
    first = args[0] if args else None
    if (
        frame is not None
        and name in frame.fp32_inside
        and isinstance(first, torch.Tensor)
        and first.dtype in _LOW
    ):
        rest, kwargs = _cast_all(args[1:], kwargs, first.dtype)
        return op(first, *rest, **kwargs)
    args, kwargs = _cast_all(args, kwargs, torch.float32, only_low=True)
    return op(*args, **kwargs)


def _promote(frame: Frame | None, args: tuple, kwargs: dict, op: Callable) -> Any:
    found: set = set()
    float_dtypes(args, found)
    float_dtypes(kwargs, found)
    if len(found) > 1 and torch.float64 not in found:
        if frame is None and set(_LOW) <= found:  # as torch.autocast does
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        args, kwargs = _cast_all(args, kwargs, torch.float32, only_low=True)
    return op(*args, **kwargs)


def _torch_kernel(op: Any, key: DispatchKey) -> Any:
    """torch's own kernel for ``op`` on ``key``, taken before mixprec registers over it (None
    where torch has none, the key falling through, or this torch cannot hand kernels out)."""
    overload = op._schema.overload_name
    qualname = op._schema.name + (f".{overload}" if overload else "")
    get_kernel = getattr(torch.library, "get_kernel", None)  # torch >= 2.9
    if get_kernel is None or not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key.name):
        return None
    return get_kernel(op, key)


_PY_DISPATCHER = torch._C.DispatchKey.PythonDispatcher


class _RuleKernel:
    """mixprec's kernel for one op on one device's Autocast key: the cast table's rule under a
    mixprec frame, else what torch does (its own kernel, taken before mixprec registered over
    it, or a fall-through)."""

    def __init__(self, name: str, device: str, op: Any) -> None:
        self.name, self.device, self.op = name, device, op
        self.key = _KEYS[device]
        self.without = DispatchKeySet(self.key)
        self.trule = _torch_rule(device, name)
        self.native = _torch_kernel(op, self.key)
        # an op torch.autocast falls through whose kernel is a decomposition (aten::lstm on CPU):
        # torch lowers the ops it decomposes into (mkldnn_rnn_layer), so they must see autocast;
        # redispatching with autocast excluded ran them in float32 (and a bf16 LSTM failed)
        self.composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"
        )

    def __call__(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frame = _frame_for_kernel(self.device)
        if frame is None or frame.dtype is None:
            return self._as_torch(keyset, args, kwargs)
        if _state.busy:  # re-entered through a Python mode's restored TLS (fake tensors)
            return self._past(keyset, args, kwargs)
        _state.busy = True
        try:
            table, opted_out = cast_table._effective()
            rule = table.get(self.name)
            if rule is None:
                rule = "input" if self.name in opted_out else self.trule
            return self._apply(rule, frame, args, kwargs)
        finally:
            _state.busy = False

    def _apply(self, rule: str | None, frame: Frame | None, args: tuple, kwargs: dict) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(self.without):
            low = torch.get_autocast_dtype(self.device)
            return apply_rule(rule, self.name, frame, low, args, kwargs, self.op)

    def _past(self, keyset: Any, args: tuple, kwargs: dict) -> Any:
        """The next kernel below the autocast key; excluded too, for the Python dispatcher (fake
        tensors, dynamo, export), which recomputes the key from the TLS, not from ``keyset``."""
        with torch._C._ExcludeDispatchKeyGuard(self.without):
            return self.op.redispatch(keyset.remove(self.key), *args, **kwargs)

    def _as_torch(self, keyset: Any, args: tuple, kwargs: dict) -> Any:
        """What torch does without mixprec: its own kernel, else fall through."""
        if self.native is not None:
            return self.native.call_boxed(keyset, *args, **kwargs)
        if self.trule is None:
            if self.composite and not torch._C._dispatch_tls_is_dispatch_key_included(
                _PY_DISPATCHER
            ):
                # fall through to the decomposition, whose ops torch.autocast sees (the Python
                # dispatcher of fake tensors recomputes keys from the TLS: it would come back)
                return self.op.redispatch(keyset.remove(self.key), *args, **kwargs)
            return self._past(keyset, args, kwargs)
        return self._apply(self.trule, None, args, kwargs)  # torch < 2.9: its rule, replayed


def _inplace_kernel(device: str, op: Any) -> Callable:
    without = DispatchKeySet(_KEYS[device])
    # by the packet: a Python number reaches a Python kernel unwrapped, and the packet picks
    # the Scalar overload for it where the original call had a wrapped-number Tensor
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1])

    def kernel(keyset: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _state.frames and self.is_leaf and self.requires_grad:
            torch.clear_autocast_cache()  # a weight changes: its cached 16-bit copy is stale
        with torch._C._ExcludeDispatchKeyGuard(without):
            return packet(self, *args, **kwargs)

    return kernel


class _ExportMode(TorchFunctionMode):
    """The cast table applied to Python-level torch calls, while ``torch.export`` traces."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        frame = top()
        name, inplace = cast_table.resolve_op(func)
        if frame is None or frame.dtype is None or inplace or kwargs.get("out") is not None:
            return func(*args, **kwargs)
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        table, opted_out = cast_table._effective()
        rule = table.get(name) or ("input" if name in opted_out else torch_rule(device, name))
        if rule is None:
            return func(*args, **kwargs)
        return apply_rule(rule, name, frame, frame.dtype, args, kwargs, func)


# -- registration -----------------------------------------------------------------------------

# one library per kernel, so that a kernel no longer needed (a rule set back) can be removed and
# torch's own kernel comes back: (device, "name.overload") -> library
_libs: dict[tuple[str, str], torch.library.Library] = {}
_synced = [-1]
_sync_lock = threading.Lock()


def _overloads(name: str, mutable: bool = False) -> list[tuple[str, Any]]:
    """The dispatcher overloads of aten op ``name``: functional ones, or only in-place ones."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    out = []
    for overload in packet.overloads():
        try:  # TorchScript-only variants (list and number overloads) have no dispatcher entry
            torch._C._dispatch_find_schema_or_throw(
                f"aten::{name}", "" if overload == "default" else overload
            )
        except RuntimeError:
            continue
        op = getattr(packet, overload)
        if op._schema.is_mutable != mutable:
            continue
        out.append((name if overload == "default" else f"{name}.{overload}", op))
    return out


_torch_has: dict[str, frozenset[str]] = {}


def _torch_rule(device: str, name: str) -> str | None:
    """torch.autocast's rule for ``name`` on ``device`` in the running torch: the recorded rule
    where this torch registers a kernel (asked once, before mixprec registers any), else None."""
    if not _torch_has:
        names = torch._C._dispatch_get_all_op_names()
        for dev, key in _KEYS.items():
            _torch_has[dev] = frozenset(
                n[len("aten::") :].split(".")[0]
                for n in names
                if n.startswith("aten::")
                and torch._C._dispatch_has_kernel_for_dispatch_key(n, key.name)
            )
    return torch_rule(device, name) if name in _torch_has[device] else None


def needs_kernel(device: str, name: str, rule: str | None, opted_out: bool) -> bool:
    """True when mixprec's rule for ``name`` on ``device`` differs from what torch does."""
    trule = _torch_rule(device, name)
    if opted_out:  # also where torch has no rule: the op's inner aten ops may have one
        return True
    if rule is None:
        return False
    if rule == PROMOTE:  # torch's promote kernels reject a second 16-bit dtype
        return name not in NATIVE_PROMOTE or trule is not None
    if rule != trule:
        return True
    if name in FP32_INSIDE_OPS:
        return True
    return device == "cpu" and name == "scaled_dot_product_attention"


def _register(device: str, qualname: str, kernel: Callable) -> None:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl(qualname, kernel, _KEYS[device].name, with_keyset=True)
    _libs[(device, qualname)] = lib


def sync(first: bool = False) -> None:
    """Register kernels for every op whose effective rule now differs from torch's."""
    if _synced[0] == -1 and not first:
        return  # nothing registered yet: the first region registers everything
    with _sync_lock:
        version = cast_table._version[0]
        if _synced[0] == version:
            return
        table, opted_out = cast_table._effective()
        names = set(table) | set(opted_out)
        wanted: set[tuple[str, str]] = set()
        for device in _KEYS:
            for name in sorted(names):
                if not needs_kernel(device, name, table.get(name), name in opted_out):
                    continue
                for qualname, op in _overloads(name):
                    wanted.add((device, qualname))
                    if (device, qualname) not in _libs:
                        _register(device, qualname, _RuleKernel(name, device, op))
            for name in _INPLACE_UPDATES:
                for qualname, op in _overloads(name, mutable=True):
                    wanted.add((device, qualname))
                    if (device, qualname) not in _libs:
                        _register(device, qualname, _inplace_kernel(device, op))
        for stale in set(_libs) - wanted:
            _libs.pop(stale)._destroy()  # torch's kernel (or the fallthrough) is back
        _synced[0] = version


def registered() -> frozenset[tuple[str, str]]:
    """``(device type, aten op overload)`` pairs that carry a mixprec kernel (diagnostics)."""
    return frozenset(_libs)


cast_table._listeners.append(sync)
assert set(TORCH_AUTOCAST) == set(_KEYS)
