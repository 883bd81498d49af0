"""Apex's user cast registrations on mixprec: ``register_half_function``, ``@float_function``...

Design (``docs/design.md``, "Compatibility layers"): a function of a torch namespace goes into
mixprec's cast table (:func:`mixprec.register_op`), so the engine applies the rule to every
spelling of the op (``torch.sigmoid``, ``Tensor.sigmoid``, ...), in the eager engine and the
graph pass alike. A function the engine cannot see -- a C++/CUDA extension, user Python -- is
wrapped instead: inside a mixed-precision region its floating arguments are cast (half: the
region's 16-bit dtype; float: float32, with casts off in the body; promote: float32 when 16-bit
and float32 arguments mix); outside a region it runs untouched. Registrations work before or
after ``amp.initialize`` (Apex: before only) and :func:`undo_registrations` reverts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import mixprec
from mixprec._core import engine
from mixprec._core._autocast_rules import float_dtypes
from mixprec._core.cast_table import rule_for

__all__ = [
    "REGISTERED",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "undo_registrations",
]

#: ``(owner, name, original)`` per registration, to undo (owner None: a cast-table rule).
REGISTERED: list[tuple[Any, str, Any]] = []
_TORCH_NAMESPACES = (
    torch,
    torch.nn.functional,
    torch.Tensor,
    torch.linalg,
    torch.special,
    torch.fft,
)
_RULES = {"half": "lower", "float": "fp32", "promote": "promote"}


def _cast_wrapper(fn: Callable, kind: str) -> Callable:
    """Wrap a function that the engine cannot see (a C++/CUDA extension, user Python)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not engine.is_active():
            return fn(*args, **kwargs)
        if kind == "half":
            low = torch.get_autocast_dtype("cpu")  # the engine sets it to the region's dtype
            return fn(*engine.cast_tree(args, low), **engine.cast_tree(kwargs, low))
        if kind == "promote":
            found = float_dtypes(kwargs, float_dtypes(args, set()))
            if not (len(found) > 1 and torch.float32 in found):
                return fn(*args, **kwargs)
        args, kwargs = (
            engine.cast_tree(args, torch.float32),
            engine.cast_tree(kwargs, torch.float32),
        )
        if kind == "float":
            with mixprec.autocast("float32"):  # casts off inside the body
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    wrapper.__wrapped_by_mixprec_amp__ = kind  # type: ignore[attr-defined]
    return wrapper


def _register(module: Any, name: str, kind: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    fn = getattr(module, name)
    if any(module is ns for ns in _TORCH_NAMESPACES):
        REGISTERED.append((None, name, (fn, rule_for(fn))))
        mixprec.register_op(fn, _RULES[kind])  # the engine sees every spelling of a torch op
        return
    REGISTERED.append((module, name, fn))
    setattr(module, name, _cast_wrapper(fn, kind))


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in 16-bit inside mixed-precision regions (Apex: FP16)."""
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in float32 inside mixed-precision regions."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest input dtype (fp16+fp32 -> fp32)."""
    _register(module, name, "promote")


def half_function(fn: Callable) -> Callable:
    """Decorator: cast floating arguments to the region's 16-bit dtype."""
    return _cast_wrapper(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: cast floating arguments to float32 and run the body with casts off."""
    return _cast_wrapper(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: if arguments mix 16-bit and float32, cast them all to float32."""
    return _cast_wrapper(fn, "promote")


def undo_registrations() -> None:
    """Revert every registration, newest first: cast-table rules and wrapped functions."""
    for owner, name, original in reversed(REGISTERED):
        if owner is None:
            fn, rule = original
            mixprec.register_op(fn, rule)
        else:
            setattr(owner, name, original)
    REGISTERED.clear()
