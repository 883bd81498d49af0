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

    A first step frees temporaries beside the states it keeps; glibc, its mmap threshold risen
    to a parameter's size by then, keeps them as holes that small allocations split and later
    steps only partly reuse: ~2 resident bytes per parameter of an AdamW model above its state.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def first_on_cpu(state: dict, params: list[Any]) -> bool:
    """Whether some of ``params`` (on one device) take their first step on a CPU: the blocks it
    frees beside their new states stay resident unless the heap is trimmed."""
    return bool(params) and params[0].device.type == "cpu" and not all(map(state.get, params))
