"""Handing freed heap pages back after an update frees many fp32 temporaries at once.

Only the update path needs this (a lean chunk's first step, a released step's first backward);
measuring memory (:mod:`mixprec._core.memory`) trims with its own ``malloc_trim`` before it reads.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["first_on_cpu", "trim_heap"]


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (nothing where there is no glibc).

    A chunk that gets its first state frees fp32 temporaries (the optimizer's fresh fp32 first
    moment, its scratch) between the state it keeps. glibc, whose mmap threshold has by then
    risen to a parameter's size, keeps them as holes in its heap, which small allocations split
    and the next chunks then only partly reuse: they stayed resident, ~2 bytes per parameter of
    an AdamW model above its state. Called after such chunks only (a first step).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def first_on_cpu(state: dict, params: list[Any]) -> bool:
    """Whether some of ``params`` (on one device) take their first step on a CPU: the blocks it
    frees beside their new states stay resident unless the heap is trimmed."""
    return bool(params) and params[0].device.type == "cpu" and not all(map(state.get, params))
