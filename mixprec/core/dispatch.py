"""The dispatcher half of the eager engine: per-thread frames and mixprec's autocast kernels.

Design (chosen by measurement, see ``benchmarks/NOTES.md``): a mixprec region *is* a
``torch.autocast`` region -- torch's C++ kernels lower matmuls and convolutions and keep its
weight-cast cache, at C++ cost -- plus Python kernels registered with ``torch.library`` on the
``AutocastCPU``/``AutocastCUDA`` dispatch keys for exactly the ops whose cast-table rule differs
from torch's rule on that device (:mod:`mixprec.core.torch_lists`): on CPU the fp32 ops torch leaves
in 16-bit (softmax, norms, reductions, exp/log/pow...), a few matmul variants, the promote ops
that need a cast, the attention kernel choice; on CUDA the fp32-inside norms and softmax and
``binary_cross_entropy``. Every other op costs nothing extra. A function mode seeing every
Python-level call cost ~6 us per call before doing any work and was dropped.

A kernel applies mixprec's rule only while a mixprec frame is on top of this thread's stack.
Reached from a user's own ``torch.autocast`` it calls torch's own kernel, taken with
``torch.library.get_kernel`` before mixprec registered over it (or falls through where torch has
none), so registering kernels changes nothing outside mixprec regions -- eager, under fake
tensors (dynamo, AOTAutograd, export), inductor or ``torch.func``. When a Python mode's restored
TLS or the Python dispatcher brings a call back to the key, the kernel steps past it with the
key excluded: the Python dispatcher recomputes the key from the TLS, not from the key set it is
handed. Inside backward (activation-checkpoint recomputation, which re-enters torch.autocast
with the forward's settings but not mixprec's frame, possibly on another thread) the frame of
the region whose autograd node is being run applies, so recomputed forwards match the original
bit for bit, and a user's own checkpointed code gets torch's rules. A backward run through
mixprec (``scale_loss``, ``opt.backward``) sets the thread's open regions aside
(:func:`outside_regions`): a region left open, as Apex's O1 shim keeps one, must not lower
another model's backward to its dtype.

Cache: torch's weight-cast cache is used (one cast per weight per region, not kept across
regions). It does not see in-place updates, so mixprec clears it when a leaf that requires grad
is updated in place inside a region (kernels on the common in-place update ops) and after every
``torch.optim`` step taken inside one. Updates through ``.data`` are invisible to it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

from mixprec.core import cast_table, kernels
from mixprec.core.cast_table import FP32, LOWER, PROMOTE
from mixprec.core.torch_lists import TORCH_AUTOCAST, torch_rule

__all__ = [
    "FP32_INSIDE_OPS",
    "NATIVE_PROMOTE",
    "Frame",
    "depth",
    "outside_regions",
    "pop",
    "push",
    "top",
]

_LOW = (torch.float16, torch.bfloat16)

# fp32-rule ops whose 16-bit kernels accumulate in float32 internally (CPU and CUDA): with
# ``fp32_inside`` they keep 16-bit inputs and outputs -- the seed's "memory-bound ops stay
# 16-bit in and out, compute in fp32 inside" -- instead of paying for two casts.
# The ATen spellings are listed too: the graph pass (mixprec.graph.paint) reads this set.
FP32_INSIDE_OPS = frozenset(
    {
        "layer_norm",
        "group_norm",
        "softmax",
        "log_softmax",
        "native_layer_norm",
        "native_group_norm",
        "_softmax",
        "_log_softmax",
    }
)

# promote-rule ops whose native kernels already compute in the widest input dtype (torch's type
# promotion): they need no cast and no kernel. 0-dim tensors and Python numbers do not widen
# them, as in torch.
NATIVE_PROMOTE = frozenset(
    {
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "true_divide",
        "atan2",
        "maximum",
        "minimum",
        "fmax",
        "fmin",
        "addcmul",
        "addcdiv",
        "where",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "equal",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "hstack",
        "vstack",
        "dstack",
    }
)

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


@dataclass(frozen=True)
class Frame:
    """One entry of a thread's region stack."""

    dtype: torch.dtype | None  # None: a float32 region, torch.autocast off
    kernels: str = "auto"
    fp32_inside: frozenset[str] = frozenset()


class _State(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.base: list[tuple[str, bool, torch.dtype]] = []  # autocast under the outermost frame
        self.busy = False  # inside one of mixprec's kernels
        self.compiling: Any = None  # a torch.compile compilation under way (mixprec.core.traced)


_state = _State()

# Backward recomputation (activation checkpointing) re-enters torch.autocast with the forward's
# dtype but not mixprec's frame, maybe on another thread. Autograd numbers the nodes it creates
# (per-thread sequence numbers): a region records the numbers of its nodes as a span, and a
# kernel run by backward takes the frame of the innermost span (of the autocast dtype) that holds
# the node being executed -- the frame its forward ran in. Anything else backward runs (a user's
# own torch.autocast and checkpoint) holds no span and gets torch's behaviour. Spans of graphs
# long gone fall off the end of the deque.
_spans: deque[tuple[int, int, Frame]] = deque(maxlen=4096)
_open: dict[int, tuple[int, Frame]] = {}  # regions not exited yet (id of their _Saved)
_span_of: dict[tuple[int, torch.dtype], Frame | None] = {}  # (node number, dtype) -> frame
_seq = getattr(torch._C._autograd, "_get_sequence_nr", None)
_current_node = getattr(torch._C, "_current_autograd_node", None)
_last: dict[torch.dtype, Frame] = {}  # torch without node numbers: the last frame of a dtype


def top() -> Frame | None:
    frames = _state.frames
    return frames[-1] if frames else None


def depth() -> int:
    return len(_state.frames)


@dataclass
class _Saved:
    autocast: list[tuple[str, bool, torch.dtype]]
    cache: bool
    mode: Any = None  # the export mode entered by this push, if any
    first_node: int = -1  # autograd's next node number at the push (eager, grad enabled)


_device_types: list[tuple[str, ...]] = []


def _devices() -> tuple[str, ...]:
    """Device types whose torch.autocast state a region sets (asked once: hot path). A plain
    list, not ``functools.cache``: dynamo warns on every traced call of a cached function."""
    if not _device_types:
        _device_types.append(("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    return _device_types[0]


def _enter(frame: Frame) -> None:
    _state.frames.append(frame)
    if frame.dtype is not None and _seq is None:
        _last[frame.dtype] = frame


def push(
    frame: Frame, cache_enabled: bool | None = None, devices: tuple[str, ...] | None = None
) -> _Saved:
    """Enter ``frame``: switch torch.autocast on (or off) for it; return what :func:`pop`
    restores. ``devices``: the device types whose autocast state the region sets (default:
    every type mixprec handles here; ``mixprec.amp.autocast`` sets only its own, as torch does)."""
    devices = _devices() if devices is None else devices
    if _synced[0] != cast_table._version[0] and not torch.compiler.is_dynamo_compiling():
        sync(first=True)
    saved = _Saved(
        [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices],
        torch.is_autocast_cache_enabled(),
    )
    if not _state.frames:
        _state.base = saved.autocast
    tracing = torch.compiler.is_dynamo_compiling()
    if tracing:  # a graph node: the compiler's tracing pushes it (mixprec.core.traced)
        _traced[0](frame.dtype, frame.kernels, bool(frame.fp32_inside))
    elif torch.compiler.is_exporting():
        # torch.export records ops above the autocast keys, where these kernels never run:
        # apply the rules at the Python level instead, so the program stores the casts
        _state.frames.append(frame)
        saved.mode = _ExportMode()
        saved.mode.__enter__()
        return saved
    else:
        _enter(frame)
        if _seq is not None and frame.dtype is not None and torch.is_grad_enabled():
            saved.first_node = _seq()
            _open[id(saved)] = (saved.first_node, frame)
    torch.autocast_increment_nesting()
    if cache_enabled is not None:
        torch.set_autocast_cache_enabled(cache_enabled and saved.cache)
    if frame.dtype is None:
        for d in devices:
            torch.set_autocast_enabled(d, False)
    else:
        if not tracing and any(was != frame.dtype for _, _, was in saved.autocast):
            # torch's cache is keyed by the weight alone: a copy in another 16-bit dtype must
            # not be served to this region (compiled code has no such cache)
            torch.clear_autocast_cache()
        for d in devices:
            torch.set_autocast_dtype(d, frame.dtype)
            torch.set_autocast_enabled(d, True)
    return saved


def pop(frame: Frame, saved: _Saved) -> None:
    if saved.mode is not None:
        saved.mode.__exit__(None, None, None)
        _state.frames.pop()
        return
    tracing = torch.compiler.is_dynamo_compiling()
    if tracing:
        _traced[1]()
    elif not _state.frames or _state.frames[-1] != frame:
        raise RuntimeError("mixprec.autocast regions were exited out of order.")
    else:
        _state.frames.pop()
        if saved.first_node >= 0:
            _open.pop(id(saved), None)
            end = _seq()
            if end > saved.first_node:  # it created nodes that backward may recompute
                _spans.append((saved.first_node, end, frame))
                _span_of.clear()
    if (
        not tracing
        and frame.dtype is not None
        and any(dt != frame.dtype for _, _, dt in saved.autocast)
    ):
        torch.clear_autocast_cache()  # the copies made for this region's dtype
    for d, on, dt in saved.autocast:
        torch.set_autocast_dtype(d, dt)
        torch.set_autocast_enabled(d, on)
    torch.set_autocast_cache_enabled(saved.cache)
    if torch.autocast_decrement_nesting() == 0 and not tracing:
        torch.clear_autocast_cache()


@contextlib.contextmanager
def outside_regions() -> Iterator[None]:
    """Run the block as if no mixprec region were open on this thread: no frames, and torch's
    autocast state as it was under the outermost one.

    A backward belongs to the forwards that built its graph, not to a region that happens to be
    open when it is called (Apex's O1 keeps one open for the whole script, and Apex's own
    patches never reached autograd's backward): inside the region torch.autocast would lower the
    backward's matmuls of *another* model to the region's dtype, and mixprec's kernels would
    apply its rules. Outside every region each backward op runs in the dtypes of its forward, and
    a recomputed forward (activation checkpointing) finds its own region's frame by node number.
    """
    frames, base = _state.frames, _state.base
    if not frames or torch.compiler.is_compiling():
        yield
        return
    now = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d, _, _ in base]
    _state.frames = []
    for d, on, dt in base:
        torch.set_autocast_dtype(d, dt)
        torch.set_autocast_enabled(d, on)
    try:
        yield
    finally:
        _state.frames, _state.base = frames, base
        for d, on, dt in now:
            torch.set_autocast_dtype(d, dt)
            torch.set_autocast_enabled(d, on)


# Under torch.compile the frame push and pop are graph nodes, set by mixprec.core.traced when
# dynamo is imported: (enter, exit).
_traced: list[Callable] = []


def _frame_for_kernel(device: str) -> Frame | None:
    compiling = _state.compiling
    if compiling is not None and not torch.compiler.is_dynamo_compiling():
        # a tracing pass of torch.compile: its own stack (and when dynamo traces this very
        # kernel, called by eager code that runs under its frame hook, nothing to do)
        compiling.sync()
    frames = _state.frames
    if frames:
        return frames[-1]
    if torch._C._current_graph_task_id() == -1:
        return None
    # backward: a recomputation of a region's forward (activation checkpointing), or not
    dtype = torch.get_autocast_dtype(device)
    if _seq is None or _current_node is None:
        return _last.get(dtype)
    node = _current_node()
    if node is None:
        return None
    key = (node._sequence_nr(), dtype)
    if key not in _span_of:
        if len(_span_of) > 4096:
            _span_of.clear()
        number, best = key[0], None
        now = _seq() + 1
        for first, end, frame in (*_spans, *((f, now, fr) for f, fr in list(_open.values()))):
            inner = best is None or end - first < best[1] - best[0]
            if first <= number < end and frame.dtype == dtype and inner:
                best = (first, end, frame)
        _span_of[key] = None if best is None else best[2]
    return _span_of[key]


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
    """Run ``op`` under ``rule`` (the cast table's rules, torch's ``"banned"``, or ``"input"``).

    ``low`` is the 16-bit dtype of ``"lower"``; ``frame`` None means torch.autocast's own
    semantics (reached outside a mixprec region).
    """
    if rule == LOWER:
        args, kwargs = _cast_all(args, kwargs, low)
        if frame is not None and frame.kernels == "auto" and name == "scaled_dot_product_attention":
            out = kernels.try_decomposed_attention(args, kwargs)
            if out is not None:
                return out
        return op(*args, **kwargs)
    if rule == FP32:
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
    if rule == PROMOTE:
        found: set = set()
        float_dtypes(args, found)
        float_dtypes(kwargs, found)
        if len(found) > 1 and torch.float64 not in found:
            if frame is None and set(_LOW) <= found:  # as torch.autocast does
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
            args, kwargs = _cast_all(args, kwargs, torch.float32, only_low=True)
        return op(*args, **kwargs)
    if rule == "banned":
        raise RuntimeError(
            f"torch.autocast refuses {name} (unsafe to autocast); use its *_with_logits form, "
            "or run it under mixprec.autocast, which computes it in float32."
        )
    return op(*args, **kwargs)  # "input": run in the inputs' dtype


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


def _rule_kernel(name: str, device: str, op: Any) -> Callable:
    key = _KEYS[device]
    without = DispatchKeySet(key)
    trule = _torch_rule(device, name)
    native = _torch_kernel(op, key)
    # an op torch.autocast falls through whose kernel is a decomposition (aten::lstm on CPU):
    # torch lowers the ops it decomposes into (mkldnn_rnn_layer), so they must see autocast;
    # redispatching with autocast excluded ran them in float32 (and a bf16 LSTM failed). The
    # decomposition's own ops come back through the dispatcher, not to this kernel.
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )

    def apply(rule: str | None, frame: Frame | None, args: tuple, kwargs: dict) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(without):
            return apply_rule(rule, name, frame, torch.get_autocast_dtype(device), args, kwargs, op)

    def past(keyset: Any, args: tuple, kwargs: dict) -> Any:
        # the next kernel below the autocast key; excluded too, for the Python dispatcher (fake
        # tensors, dynamo, export), which recomputes the key from the TLS, not from ``keyset``
        with torch._C._ExcludeDispatchKeyGuard(without):
            return op.redispatch(keyset.remove(key), *args, **kwargs)

    def as_torch(keyset: Any, args: tuple, kwargs: dict) -> Any:
        """What torch does without mixprec: its own kernel, else fall through."""
        if native is not None:
            return native.call_boxed(keyset, *args, **kwargs)
        if trule is None:
            if composite and not torch._C._dispatch_tls_is_dispatch_key_included(_PY_DISPATCHER):
                # fall through to the decomposition, whose ops torch.autocast sees (the Python
                # dispatcher of fake tensors recomputes keys from the TLS: not there, it would
                # come back here)
                return op.redispatch(keyset.remove(key), *args, **kwargs)
            return past(keyset, args, kwargs)
        return apply(trule, None, args, kwargs)  # torch < 2.9: its rule, replayed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frame = _frame_for_kernel(device)
        if frame is None or frame.dtype is None:
            return as_torch(keyset, args, kwargs)
        if _state.busy:  # re-entered through a Python mode's restored TLS (fake tensors)
            return past(keyset, args, kwargs)
        _state.busy = True
        try:
            table, opted_out = cast_table._effective()
            rule = table.get(name)
            if rule is None:
                rule = "input" if name in opted_out else trule
            return apply(rule, frame, args, kwargs)
        finally:
            _state.busy = False

    return kernel


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
                        _register(device, qualname, _rule_kernel(name, device, op))
            if _synced[0] == -1:
                for name in _INPLACE_UPDATES:
                    for qualname, op in _overloads(name, mutable=True):
                        _register(device, qualname, _inplace_kernel(device, op))
            wanted |= {
                (device, q) for name in _INPLACE_UPDATES for q, _ in _overloads(name, mutable=True)
            }
        for stale in set(_libs) - wanted:
            _libs.pop(stale)._destroy()  # torch's kernel (or the fallthrough) is back
        _synced[0] = version


def registered() -> frozenset[tuple[str, str]]:
    """``(device type, aten op overload)`` pairs that carry a mixprec kernel (diagnostics)."""
    return frozenset(_libs)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _state.frames:
        torch.clear_autocast_cache()  # weights changed in place inside a region


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after module ``name`` is first imported (a post-import
    hook: the module itself is loaded as usual, by its own finder and loader)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot, and out of the way of the real lookup
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load, callback = spec.loader.exec_module, self.callback

        def exec_module(module: Any) -> None:
            load(module)
            callback()

        spec.loader.exec_module = exec_module  # this module's own loader object
        return spec


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` right after module ``name`` is first imported."""
    sys.meta_path.insert(0, _AfterImport(name, callback))


register_optimizer_step_post_hook(_after_step)
cast_table._listeners.append(sync)
assert set(TORCH_AUTOCAST) == set(_KEYS)
