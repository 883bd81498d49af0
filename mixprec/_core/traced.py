"""Engine frames under ``torch.compile``: what the compiler's traces see, and what they leave.

Design (``docs/design.md``, "The eager engine"): the push and pop of a region are graph nodes
(:func:`enter`, :func:`exit`) that run while the compiler traces, so each trace sees the frames
eager mode would and a compiled region never touches the stack. A graph break splits a region;
each tracing pass starts from the run-time stack and the compile's end restores it, and a graph
that leaves the stack unbalanced records its pushes and pops as ops (``mixprec::enter_frame``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from mixprec._core import _autocast_rules, _frames, cast_table
from mixprec._core._autocast_rules import FP32_INSIDE_OPS
from mixprec._core._frames import Frame, _state
from mixprec._core.hardware import MixprecPerformanceWarning

_MODES = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)


class _Compilation:
    """One dynamo compilation on this thread: the run-time stack, and the tracing passes so far."""

    def __init__(self, frames: list[Frame]) -> None:
        self.snapshot = list(frames)
        self.passes: list[tuple[Any, ...]] = []  # the modes of each pass (held: ids stay unique)
        self.keep_ops: bool | None = None  # decided when AOTAutograd's first pass begins
        self.open: list[bool] = []  # per frame this pass pushed: entered in torch.autocast's way
        self.lost = False  # a region split without torch.autocast regions to carry its state

    def sync(self) -> None:
        """Start the stack afresh from the snapshot when a new tracing pass begins."""
        modes = tuple(torch._C._get_dispatch_mode(k) for k in _MODES)
        if any(all(a is b for a, b in zip(modes, seen)) for seen in self.passes):
            return  # the same pass, or one resumed (a re-propagation): its stack stands
        self.passes.append(modes)
        if self.keep_ops is None and (modes[1] is not None or modes[2] is not None):
            # AOTAutograd's first pass: dynamo's trace of the graph is complete
            self.keep_ops = _state.frames != self.snapshot
            self.lost = not all(self.open)
        _state.frames[:] = self.snapshot
        self.open = []

    def recording(self) -> bool:
        return bool(self.keep_ops) and not torch.compiler.is_exporting()


def _compilation() -> _Compilation | None:
    """This thread's compilation. ``torch._dynamo.reset()`` drops compile callbacks: a trace
    (fake tensors, in dynamo's tracing context) without one registers them again and starts it
    here, before its first push or pop changes the stack."""
    if (
        _state.compiling is None
        and torch._C._get_dispatch_mode(_MODES[0]) is not None
        and torch._guards.TracingContext.try_get() is not None
    ):
        _add_callbacks(sys.modules["torch._dynamo"])
        _compile_start()
    return _state.compiling


def _frame(dtype: torch.dtype | None, kernels: str, fp32_inside: bool) -> Frame:
    return Frame(dtype, kernels, FP32_INSIDE_OPS if fp32_inside else frozenset())


def enter(
    dtype: torch.dtype | None, kernels: str, fp32_inside: bool, in_autocast: bool = False
) -> None:
    """The push of a region, as a graph node; ``in_autocast``: inside torch.autocast regions
    of the frame's setting (a module boundary), which dynamo carries across a graph break."""
    if _autocast_rules._synced[0] != cast_table._version[0]:
        _autocast_rules.sync(first=True)
    compiling = _compilation()
    if compiling is None:  # run as it stands (a backend that runs dynamo's graph eagerly)
        _frames._enter(_frame(dtype, kernels, fp32_inside))
        return
    compiling.sync()
    _state.frames.append(_frame(dtype, kernels, fp32_inside))
    compiling.open.append(in_autocast)
    if compiling.recording():
        torch.ops.mixprec.enter_frame(dtype, kernels, fp32_inside)


def exit() -> None:
    """The pop of a region, as a graph node."""
    compiling = _compilation()
    if compiling is None:  # run as it stands (a backend that runs dynamo's graph eagerly)
        _state.frames.pop()
        return
    compiling.sync()
    if compiling.recording():
        torch.ops.mixprec.exit_frame()
    if _state.frames:  # empty: a region that began before a graph the run did not keep
        _state.frames.pop()
    if compiling.open:
        compiling.open.pop()


# -- the run-time ops of an unbalanced graph -------------------------------------------------

_lib: list[torch.library.Library] = []  # defined when mixprec registers with dynamo


def _define_ops() -> None:
    lib = torch.library.Library("mixprec", "FRAGMENT")
    lib.define("enter_frame(ScalarType? dtype, str kernels, bool fp32_inside) -> ()")
    lib.define("exit_frame() -> ()")
    lib.impl("enter_frame", _enter_frame, "CompositeExplicitAutograd")
    lib.impl("exit_frame", _exit_frame, "CompositeExplicitAutograd")
    torch.library.register_fake("mixprec::enter_frame", _traced_already, lib=lib)
    torch.library.register_fake("mixprec::exit_frame", _traced_already, lib=lib)
    ops = torch.ops.mixprec
    for fn in (enter, exit, ops.enter_frame.default, ops.exit_frame.default):
        torch.fx.node.has_side_effect(fn)
    _lib.append(lib)


def _enter_frame(dtype: torch.dtype | None, kernels: str, fp32_inside: bool) -> None:
    _state.frames.append(_frame(dtype, kernels, fp32_inside))


def _exit_frame() -> None:
    if _state.frames:
        _state.frames.pop()


def _traced_already(*args: Any) -> None:
    """Under fake tensors (a trace): the graph node's own Python did the work."""


# -- wiring, when dynamo arrives --------------------------------------------------------------


def _compile_start(*args: Any) -> None:
    if _state.compiling is None:
        _state.compiling = _Compilation(_state.frames)


_warned: list[bool] = []


def _compile_end(*args: Any) -> None:
    compiling, _state.compiling = _state.compiling, None
    if compiling is None:
        return
    _state.frames[:] = compiling.snapshot
    if compiling.keep_ops and compiling.lost and not _warned:
        _warned.append(True)  # once a process
        warnings.warn(
            "torch.compile split a mixprec.autocast region at a graph break: under "
            "AOTAutograd backends (inductor) the code from the break to the region's end runs "
            "without mixed precision. Find the break with torch._dynamo.explain(fn)(inputs) "
            "and remove it, or put the region inside a module that mixprec.initialize or "
            "set_policy prepared (a module's region survives a graph break).",
            MixprecPerformanceWarning,
            stacklevel=2,
        )


def _add_callbacks(dynamo: Any) -> None:
    handler = getattr(dynamo, "callback_handler", None)
    if handler is None:
        return
    if _compile_start not in getattr(handler, "start_callbacks", ()):
        handler.register_start_callback(_compile_start)
    if _compile_end not in getattr(handler, "end_callbacks", ()):
        handler.register_end_callback(_compile_end)


def dynamo_traces_autocast_setters() -> bool:
    """torch >= 2.13's dynamo records torch.set_autocast_dtype and autocast_increment_nesting in
    the graph; older ones graph-break on them, half-way through :func:`.regions.push`."""
    rules = getattr(
        sys.modules.get("torch._dynamo.trace_rules"), "torch_c_binding_in_graph_functions", {}
    )
    return "torch.set_autocast_dtype" in rules and "torch._C.autocast_increment_nesting" in rules


_in_graph = [False]


def frames_in_graph() -> bool:
    """True where dynamo keeps a region's push and pop in its graph (torch >= 2.13)."""
    return _in_graph[0]


def register_with_dynamo() -> bool:
    """Make the frame push/pop graph nodes for dynamo (idempotent, at mixprec's first use once
    dynamo is loaded: this never imports it); return :func:`frames_in_graph`."""
    if _frames._traced:
        return _in_graph[0]
    dynamo = sys.modules["torch._dynamo"]
    _define_ops()
    dynamo.allow_in_graph(enter)
    dynamo.allow_in_graph(exit)
    _add_callbacks(dynamo)
    _in_graph[0] = dynamo_traces_autocast_setters()
    _frames._traced[:] = [enter, exit]
    return _in_graph[0]
