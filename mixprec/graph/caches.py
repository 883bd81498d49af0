"""Generation caches are off in the graphs the pass builds.

Design: Hugging Face decoders (and encoder-decoders such as T5) return a key/value cache
(``DynamicCache``, ``EncoderDecoderCache``) whenever ``config.use_cache`` is on, which is their
default. torch.export cannot flatten those classes (they are not pytrees), and a training step
has no use for them: a cache only speeds up generation token by token, with a new input shape and
``past_key_values`` fed back at every step, which one captured graph does not serve. So
:func:`mixprec.convert` captures with the cache off, and :func:`mixprec.graph.compile` calls the
model with ``use_cache=False`` unless the caller passes ``use_cache`` itself.

The alternative, registering the cache classes as pytrees (transformers has helpers for its own
exports), would make every layer's keys and values graph outputs: the pass would cast them back to
float32 (the policy's output dtype) and they would stay alive with the outputs, memory and casts a
training step never uses.

A model "has a cache switch" when its forward takes ``use_cache`` and a ``config`` somewhere in
it carries a ``use_cache`` attribute: the transformers convention. Other models are untouched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["has_cache_switch", "no_cache", "strip_use_cache"]


def _configs(model: nn.Module) -> list[Any]:
    """Distinct config objects with a ``use_cache`` attribute, on the model or its submodules."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "use_cache"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def has_cache_switch(model: nn.Module) -> bool:
    """True when ``model.forward`` takes ``use_cache`` and a config of the model carries it."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params and bool(_configs(model))


@contextlib.contextmanager
def no_cache(model: nn.Module) -> Iterator[None]:
    """Set ``config.use_cache = False`` on every config of ``model`` for the block, then restore.

    The model reads the flag while it is traced, so the captured graph returns no cache.
    """
    configs = [c for c in _configs(model) if c.use_cache]
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs:
            c.use_cache = True


def strip_use_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without a ``use_cache=False``/``None`` the graph already implies.

    Raises:
        ValueError: ``use_cache=True``: the converted graph has no cache to return.
    """
    if "use_cache" not in kwargs or not has_cache_switch(model):
        return kwargs
    kwargs = dict(kwargs)
    if kwargs.pop("use_cache"):
        raise ValueError(
            f"mixprec.convert captures {type(model).__name__} without its key/value cache "
            "(use_cache=False): a training graph has no use for it, and torch.export cannot "
            "return it. Received use_cache=True. Call the original model for generation, or "
            "drop use_cache from the call."
        )
    return kwargs
