"""mixprec's warning classes, and where a warning points: the user's line, however deep inside
mixprec it was raised (a fixed ``stacklevel`` breaks whenever a call path gains a frame).

Every warning is a :class:`MixprecWarning` (a ``UserWarning``); :class:`MixprecNumericsWarning`
is a ``RuntimeWarning`` too, and :class:`MixprecPerformanceWarning` says a setting runs slower
than it should. Public in :mod:`mixprec.warnings`; :mod:`mixprec.amp` warns as ``torch.amp``.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = [
    "MixprecNumericsWarning",
    "MixprecPerformanceWarning",
    "MixprecWarning",
    "user_stacklevel",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, _PACKAGE + os.sep)


class MixprecWarning(UserWarning):
    """Base class of every warning mixprec emits."""


class MixprecNumericsWarning(MixprecWarning, RuntimeWarning):
    """Values at risk: a setting that can round to 0, overflow, or leave a step non-finite."""


class MixprecPerformanceWarning(MixprecWarning):
    """A setting runs slower than it should here (a 16-bit dtype on a device without fast
    16-bit math, a path without its fused kernel)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside mixprec and torch, for a
    ``warnings.warn`` in the function that calls this."""
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
