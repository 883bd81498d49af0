"""Engine frames under ``torch.compile``: what the compiler's traces see, and what they leave.

A mixprec region pushes a frame on this thread's stack, which mixprec's kernels read
(:mod:`mixprec.core.dispatch`). Under ``torch.compile`` the push and pop become graph nodes
(:func:`enter`, :func:`exit`, ``allow_in_graph``). They run while the compiler traces: dynamo on
fake tensors, then each of AOTAutograd's passes over the graph. So every trace sees the frames
that eager mode would, and the frame's casts are baked into the compiled code. A graph that holds
a whole region compiles to code that never touches the stack, at no run-time cost.

A graph break inside a region (a ``print``, an ``.item()``, a data-dependent branch) splits it:
one graph ends after the push, the next starts before the pop. Every tracing pass of the first
graph ran the push and none the pop, and the frames they left on the thread leaked into whatever
ran next, plain ``torch.autocast`` code included (its ops took mixprec's rules). So traces leave
no trace: a compilation starts from the stack as it stands at run time (a snapshot at dynamo's
compile-start callback), each tracing pass starts again from that snapshot (a pass is told apart
by the fake, proxy and functional mode objects it runs under), and the compile-end callback
restores it.

What this does not give: the code at a graph break, and the graph after it, run without the
region under AOTAutograd backends (inductor). AOTAutograd calls the compiled graph with autocast
disabled and restores autocast's state on return, so the frame's autocast switch, made while
tracing, is not in force at run time; the rest of the region runs in its inputs' dtypes, as
plain code, until the region's end (a warning says so). Whole regions in one graph (no
break) are unaffected.

A torch whose dynamo cannot record autocast's setters in a graph (before 2.13) runs the push
and pop eagerly, with one graph break at each boundary. There the stack is only ever changed at
run time.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from mixprec.core import cast_table, dispatch
from mixprec.core.dispatch import FP32_INSIDE_OPS, Frame
from mixprec.core.hardware import MixprecPerformanceWarning

_state = dispatch._state
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
        self.current: tuple[Any, ...] | None = None
        self.split = False  # a graph ends inside a region, or starts inside one
        self.aot = False  # AOTAutograd traced (its passes run under proxy or functional modes)

    def sync(self) -> None:
        """Start the stack afresh from the snapshot when a new tracing pass begins."""
        modes = tuple(torch._C._get_dispatch_mode(k) for k in _MODES)
        if self.current is not None and all(a is b for a, b in zip(modes, self.current)):
            return
        self.current = modes
        if any(all(a is b for a, b in zip(modes, seen)) for seen in self.passes):
            return  # a pass resumed (a re-propagation under dynamo's modes): its stack stands
        self.passes.append(modes)
        self.aot = self.aot or modes[1] is not None or modes[2] is not None
        self.split = self.split or _state.frames != self.snapshot
        _state.frames[:] = self.snapshot

    def pop(self) -> None:
        """A region's pop: of a frame this trace pushed; else the region began before this
        graph (a graph break inside it)."""
        if len(_state.frames) > len(self.snapshot):
            _state.frames.pop()
        else:
            self.split = True


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


@torch.fx.node.has_side_effect
def enter(dtype: torch.dtype | None, kernels: str, fp32_inside: bool) -> None:
    """The push of a region, as a graph node."""
    if dispatch._synced[0] != cast_table._version[0]:
        dispatch.sync(first=True)
    compiling = _compilation()
    if compiling is None:  # run as it stands (a backend that runs dynamo's graph eagerly)
        dispatch._enter(_frame(dtype, kernels, fp32_inside))
        return
    compiling.sync()
    _state.frames.append(_frame(dtype, kernels, fp32_inside))


@torch.fx.node.has_side_effect
def exit() -> None:
    """The pop of a region, as a graph node."""
    compiling = _compilation()
    if compiling is None:  # run as it stands (a backend that runs dynamo's graph eagerly)
        _state.frames.pop()
        return
    compiling.sync()
    compiling.pop()


# -- wiring, when dynamo arrives --------------------------------------------------------------


def _compile_start(*args: Any) -> None:
    if _state.compiling is None:
        _state.compiling = _Compilation(_state.frames)


_warned: list[bool] = []


def _compile_end(*args: Any) -> None:
    compiling, _state.compiling = _state.compiling, None
    if compiling is None:
        return
    if compiling.aot and (compiling.split or _state.frames != compiling.snapshot) and not _warned:
        _warned.append(True)  # once a process
        warnings.warn(
            "torch.compile split a mixprec region at a graph break: under AOTAutograd "
            "backends (inductor) the code from the break to the region's end runs without "
            "mixed precision. Find the break with torch._dynamo.explain(model)(inputs) or "
            "torch.compile(..., fullgraph=True), and remove it, or compile the modules "
            "inside the region one by one.",
            MixprecPerformanceWarning,
            stacklevel=2,
        )
    _state.frames[:] = compiling.snapshot


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
    the graph; older ones graph-break on them, half-way through :func:`dispatch.push`."""
    rules = getattr(
        sys.modules.get("torch._dynamo.trace_rules"), "torch_c_binding_in_graph_functions", {}
    )
    return "torch.set_autocast_dtype" in rules and "torch._C.autocast_increment_nesting" in rules


_in_graph = [False]


def frames_in_graph() -> bool:
    """True where dynamo keeps a region's push and pop in its graph (torch >= 2.13)."""
    return _in_graph[0]


def register_with_dynamo() -> None:
    """Make the frame push/pop graph nodes for dynamo. Run when ``torch._dynamo`` is imported
    (by the first torch.compile or torch.export), not at ``import mixprec``: importing dynamo
    took ~1.9 s of the ~2.1 s mixprec added to ``import torch`` (EPYC, torch 2.13)."""
    dynamo = sys.modules["torch._dynamo"]
    dynamo.allow_in_graph(enter)
    dynamo.allow_in_graph(exit)
    _add_callbacks(dynamo)
    dispatch._traced[:] = [enter, exit]
    _in_graph[0] = dynamo_traces_autocast_setters()
    if not _in_graph[0]:
        # Older dynamo: run push/pop eagerly (one clean graph break at each module boundary)
        # rather than half-traced, which left a frame pushed by a graph node without its pop.
        dispatch.push = dynamo.disable(dispatch.push)
        dispatch.pop = dynamo.disable(dispatch.pop)


if "torch._dynamo" in sys.modules:
    register_with_dynamo()
else:
    dispatch.after_import("torch._dynamo", register_with_dynamo)
