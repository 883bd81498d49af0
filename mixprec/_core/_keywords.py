"""Keywords that became Recipe fields: a TypeError that names the field and the call to write.

Design: entry points take a :class:`~mixprec.Recipe` plus their own arguments only, so an old
keyword (``initialize(..., update=None)``) must fail loudly -- with the field that replaces it
and the recipe to pass -- rather than with Python's bare "unexpected keyword argument". The
decorator keeps the entry point's signature (``inspect.signature`` follows ``__wrapped__``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["refuse_moved_keywords"]

_LEVEL_NAMES = ("O0", "O1", "O2", "O3")


def refuse_moved_keywords(
    entry: str, moved: Mapping[str, str], call: str = "{entry}(model, optimizer, {recipe})"
) -> Callable[[Any], Any]:
    """Turn a keyword that became a Recipe field into a TypeError naming the field and the
    call that replaces it; the decorated function's signature is unchanged."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            old = [k for k in kwargs if k in moved]
            if old:
                key = old[0]
                raise TypeError(_moved_message(entry, key, kwargs[key], moved, args, call))
            return fn(*args, **kwargs)

        return checked

    return decorate


def _moved_message(
    entry: str, key: str, value: Any, moved: Mapping[str, str], args: Any, call: str
) -> str:
    field = moved[key]
    if key in ("level", "policy") or field == "recipe":  # the recipe argument itself
        return (
            f"{entry}() no longer takes {key}=; pass it as the recipe argument: "
            f"{call.format(entry=entry, recipe=repr(value))} (a level name, a Policy or a "
            "Recipe)."
        )
    level = next((a for a in args if isinstance(a, str) and a.upper() in _LEVEL_NAMES), "O2")
    dtype = next((a for a in args if isinstance(a, torch.dtype)), torch.bfloat16)
    base = f"mixprec.Recipe.from_name({level!r}, {dtype})"
    if field.startswith("loss_scale="):
        example = f"{base}.replace(loss_scale=mixprec.LossScaling({key}={value!r}))"
    else:
        example = f"{base}.replace({field}={value!r})"
    return (
        f"{entry}() no longer takes {key}=; it is the Recipe field {field!r}. Pass a recipe: "
        f"{call.format(entry=entry, recipe=example)}."
    )
