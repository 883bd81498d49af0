"""Where a mixprec warning points: the user's line, however deep inside mixprec it was raised.

Design: a fixed ``stacklevel`` breaks whenever a call path gains a frame (a decorator, a split
function), and then points the warning at mixprec's own code, which the user cannot act on.
The first frame outside mixprec and torch is the user's call, whatever the path.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, _PACKAGE + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside mixprec and torch, for a
    ``warnings.warn`` in the function that calls this."""
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
