"""The engine's per-thread region stack, and which frame a kernel run by backward belongs to.

A mixprec region pushes a :class:`Frame` on this thread's stack (:mod:`mixprec._core.regions`);
the autocast kernels read the top one. Backward recomputation (activation checkpointing) finds
the frame of its forward by autograd node number: a region records the numbers of the nodes it
created as a span, and a kernel run by backward takes the innermost span holding the node being
executed. Design: ``docs/design.md``, "The eager engine".
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Frame", "depth", "outside_regions", "top"]


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
        self.compiling: Any = None  # a torch.compile compilation under way (mixprec._core.traced)


_state = _State()

# backward's view of the regions (see the module docstring)
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


def _enter(frame: Frame) -> None:
    _state.frames.append(frame)
    if frame.dtype is not None and _seq is None:
        _last[frame.dtype] = frame


@contextlib.contextmanager
def outside_regions() -> Iterator[None]:
    """Run the block (a backward) as if no mixprec region were open on this thread: no frames,
    and torch's autocast state as it was under the outermost one."""
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


# Under torch.compile the frame push and pop are graph nodes, set by mixprec._core.traced when
# mixprec registers with dynamo (mixprec._core.regions.enable): (enter, exit).
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
    return _frame_in_backward(device)


def _frame_in_backward(device: str) -> Frame | None:
    """The frame of the region whose autograd node backward is running (a recomputation of its
    forward under activation checkpointing), or None (not one of mixprec's)."""
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
