"""Example inputs, as every inference tool takes them: a tensor, a tuple of positional
arguments, or a dict of keyword arguments.

A module of its own so that preparing, quantizing, exporting and benchmarking a model all read
example inputs the same way without importing one another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["call_model"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
