"""A region's entry into torch's dispatch state, and what mixprec registers with torch at first use.

:func:`push` and :func:`pop` enter and leave a frame of the region stack (:mod:`._frames`) and
set torch.autocast's state, the Autocast dispatch keys that mixprec's kernels sit on; under
``torch.compile`` they are graph nodes (:mod:`.traced`). :func:`enable` registers what regions
need once, at mixprec's first use. Design: ``docs/design.md``, "The eager engine".
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixprec._core import cast_table, traced
from mixprec._core._autocast_rules import _ExportMode, _synced, sync
from mixprec._core._frames import Frame, _enter, _open, _seq, _span_of, _spans, _state, _traced

__all__ = ["after_import", "enable", "pop", "push", "ready_for_dynamo"]


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


def push(
    frame: Frame, cache_enabled: bool | None = None, devices: tuple[str, ...] | None = None
) -> _Saved:
    """Enter ``frame``: set torch.autocast for it on ``devices`` (default: every type mixprec
    handles; ``mixprec.amp.autocast`` sets its own); return what :func:`pop` restores."""
    devices = _devices() if devices is None else devices
    tracing = torch.compiler.is_dynamo_compiling()
    if tracing:
        ready_for_dynamo()  # the first region may be the one dynamo traces: registers first
    elif not _enabled[0]:
        enable()
    if _synced[0] != cast_table._version[0] and not tracing:
        sync(first=True)
    saved = _Saved(
        [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices],
        torch.is_autocast_cache_enabled(),
    )
    if not _state.frames:
        _state.base = saved.autocast
    if tracing:  # a graph node: the compiler's tracing pushes it (mixprec._core.traced)
        _traced[0](frame.dtype, frame.kernels, bool(frame.fp32_inside))
    elif torch.compiler.is_exporting():
        return _push_for_export(frame, saved)
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


def _push_for_export(frame: Frame, saved: _Saved) -> _Saved:
    """torch.export records ops above the autocast keys, where these kernels never run: the
    rules apply at the Python level instead, so the program stores the casts."""
    _state.frames.append(frame)
    saved.mode = _ExportMode()
    saved.mode.__enter__()
    return saved


def pop(frame: Frame, saved: _Saved) -> None:
    """Leave ``frame``: restore what :func:`push` saved."""
    if saved.mode is not None:
        return _pop_for_export(saved)
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
    low = frame.dtype
    if not tracing and low is not None and any(dt != low for _, _, dt in saved.autocast):
        torch.clear_autocast_cache()  # the copies made for this region's dtype
    for d, on, dt in saved.autocast:
        torch.set_autocast_dtype(d, dt)
        torch.set_autocast_enabled(d, on)
    torch.set_autocast_cache_enabled(saved.cache)
    if torch.autocast_decrement_nesting() == 0 and not tracing:
        torch.clear_autocast_cache()


def _pop_for_export(saved: _Saved) -> None:
    saved.mode.__exit__(None, None, None)
    _state.frames.pop()


# -- first use --------------------------------------------------------------------------------

_enabled = [False]
_enable_lock = threading.Lock()


def enable() -> None:
    """Register with torch what mixprec's regions need (idempotent; design.md: first use)."""
    if _enabled[0]:
        return
    with _enable_lock:
        if _enabled[0]:
            return
        register_optimizer_step_post_hook(_after_step)
        if "torch._dynamo" in sys.modules:
            _with_dynamo()
        else:
            after_import("torch._dynamo", _with_dynamo)
        _enabled[0] = True


def _with_dynamo() -> None:
    global push, pop
    if not traced.register_with_dynamo():
        # Older dynamo: run push/pop eagerly (one clean graph break at each module boundary)
        # rather than half-traced, which left a frame pushed by a graph node without its pop.
        disable = sys.modules["torch._dynamo"].disable
        push, pop = disable(push), disable(pop)


def ready_for_dynamo() -> bool:
    """:func:`enable`, then whether dynamo keeps a region's push and pop in its graph
    (torch >= 2.13). A constant for dynamo: it runs this while tracing instead of tracing it."""
    enable()
    return traced.frames_in_graph()


ready_for_dynamo._dynamo_marked_constant = True  # torch.compiler.assume_constant_result's mark


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
