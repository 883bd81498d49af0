"""``mixprec.amp.autocast``: ``torch.autocast`` itself, plus mixprec's cast table on request.

Design: :class:`autocast` *is* a ``torch.autocast`` (a subclass that changes nothing by
default), so code written for torch runs with torch's own op lists and kernels, bit for bit,
and so do ``torch.compile``, ``torch.export`` and activation checkpointing, which know
``torch.autocast`` regions. One keyword-only option is added: ``cast_rules="mixprec"`` (or a
``{op: rule}`` mapping) runs the region under mixprec's cast table -- float32 softmax, norms,
reductions and losses on CPU as on CUDA, promotion instead of an error for an fp16/bf16 mix,
the user's ``mixprec.register_op`` rules -- by pushing a mixprec engine frame for this device
type only (:mod:`mixprec._core.regions`).

Fixed here: ``is_autocast_available("foo")`` answers False instead of raising, and a region
nested in one of another 16-bit dtype clears torch's weight-cast cache on entry and exit (torch
keys the cache by the weight alone and served the other dtype's copy: a dtype-mismatch error).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
from torch.amp.autocast_mode import autocast as _TorchAutocast
from torch.amp.autocast_mode import custom_bwd, custom_fwd

from mixprec._core import _autocast_rules, cast_table, regions
from mixprec._core._frames import Frame

__all__ = ["autocast", "custom_bwd", "custom_fwd", "is_autocast_available"]

# torch < 2.5 has no such class: there dynamo treats every autocast alike
_Unmanaged: type = getattr(torch.amp.autocast_mode, "_UnmanagedAutocast", _TorchAutocast)
_TABLE_DEVICES = tuple(_autocast_rules._KEYS)  # device types that carry mixprec's autocast kernels

# regions entered so far per (device type, dtype): GradScaler reads it to notice a bfloat16
# run (a process-wide tally, like torch's own autocast state of the thread that runs it)
REGIONS: collections.Counter[tuple[str, torch.dtype]] = collections.Counter()


def is_autocast_available(device_type: str) -> bool:
    """True when autocast can run on ``device_type`` (``"cpu"``, ``"cuda"``, ``"xpu"``, ...).

    Unlike ``torch.amp.is_autocast_available``, a string that names no device type answers
    False instead of raising; anything but a string raises TypeError.
    """
    if not isinstance(device_type, str):
        raise TypeError(
            f"is_autocast_available expects a device type string such as 'cuda' or 'cpu'; "
            f"received {type(device_type).__name__} {device_type!r} (for a torch.device, "
            "pass device.type)."
        )
    try:
        return bool(torch._C._is_autocast_available(device_type))
    except RuntimeError:  # "Invalid device string", "Expected one of cpu, cuda, ..."
        return False


def _check_rules(rules: Any) -> Mapping[Any, str | None] | None:
    """``cast_rules`` as overrides for :func:`mixprec.numerics.cast_rules` ({} for
    ``"mixprec"``)."""
    if isinstance(rules, str) and rules == "mixprec":
        return {}
    if isinstance(rules, Mapping):
        if torch.compiler.is_compiling():
            return rules  # refused with the fix at __enter__
        for op, rule in rules.items():
            cast_table.op_name(op)  # raises TypeError for what is not an op
            if rule is not None and rule not in cast_table.RULES:
                raise ValueError(
                    f"cast_rules[{op!r}] = {rule!r} is not a rule; use one of "
                    f"{cast_table.RULES}, or None for the op's input dtype."
                )
        return rules
    raise ValueError(
        f"cast_rules must be None (torch.autocast's own op lists), 'mixprec' (mixprec's cast "
        f"table) or a mapping {{op: rule}} applied on top of mixprec's table; received "
        f"{rules!r}."
    )


class autocast(_TorchAutocast):
    """``torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)``.

    Same arguments, defaults, errors and warnings as torch (``dtype=None`` means the device's
    autocast dtype: bfloat16 on CPU, float16 on CUDA); usable as a context manager or a
    decorator.

    Args:
        cast_rules: keyword-only. ``None`` (default): torch.autocast's op lists for the device.
            ``"mixprec"``: mixprec's cast table (float32 softmax, norms, reductions and losses
            on every device, promotion for an fp16/bf16 mix, rules set with
            ``mixprec.register_op``). A mapping ``{op: "lower" | "fp32" | "promote" | None}``:
            mixprec's table with these overrides inside the region (as
            ``mixprec.numerics.cast_rules``).
            Only for device types ``"cpu"`` and ``"cuda"``. Under ``torch.compile``, make the
            region inside the compiled function: it is then part of the graph. Like
            ``mixprec.autocast``, a region object made outside it (or a decorator) is not
            applied to the compiled code behind the graph break it causes. A mapping cannot
            be traced: register its rules with ``mixprec.register_op`` instead.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> with autocast("cpu", torch.bfloat16):
        ...     y = lin(torch.randn(2, 4)).softmax(-1)
        >>> y.dtype  # torch's CPU list runs softmax in bfloat16
        torch.bfloat16
        >>> with autocast("cpu", torch.bfloat16, cast_rules="mixprec"):
        ...     y = lin(torch.randn(2, 4)).softmax(-1)
        >>> y.dtype  # mixprec's table runs it in float32
        torch.float32
    """

    def __new__(cls, *args: Any, cast_rules: Any = None, **kwargs: Any) -> autocast:
        table = cast_rules is not None and cls is autocast
        return super().__new__(_TableAutocast if table else cls)

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        cast_rules: str | Mapping[Any, str | None] | None = None,
    ) -> None:
        super().__init__(device_type, dtype, enabled, cache_enabled)
        self._overrides = None if cast_rules is None else _check_rules(cast_rules)
        if self._overrides is not None and self.device not in _TABLE_DEVICES:
            raise ValueError(
                f"cast_rules needs device_type 'cpu' or 'cuda' (where mixprec's kernels are "
                f"registered); received {self.device!r}. Leave cast_rules=None for "
                "torch.autocast's own lists on this device."
            )
        self._frames: list[tuple[Frame, Any, Any]] = []  # (frame, saved state, rules scope)
        self._stale: list[bool] = []  # per entry: the cast cache held another dtype's copies

    def __enter__(self) -> autocast:
        if self._enabled and not torch.compiler.is_compiling():
            REGIONS[(self.device, self.fast_dtype)] += 1
        if self._overrides is None or not self._enabled:
            # torch's cast cache is keyed by the weight alone: a region nested in one of another
            # dtype was served the outer dtype's copies ("mat1 and mat2 must have the same
            # dtype"), and the outer region the inner's afterwards. Clear it at both edges.
            stale = (
                self._enabled
                and not torch.compiler.is_compiling()
                and torch.is_autocast_enabled(self.device)
                and torch.get_autocast_dtype(self.device) != self.fast_dtype
            )
            self._stale.append(stale)
            if stale:
                torch.clear_autocast_cache()
            return super().__enter__()
        scope = None
        if self._overrides:  # "mixprec" alone changes no rule: no scope to trace or sync
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "autocast(cast_rules={...}) cannot be traced by torch.compile: its rules "
                    "change mixprec's kernel registry. Register them before compiling "
                    "(mixprec.register_op(op, rule)) and use cast_rules='mixprec'."
                )
            scope = cast_table.cast_rules(self._overrides)
            scope.__enter__()
        frame = Frame(self.fast_dtype, "torch")
        saved = regions.push(frame, cache_enabled=self._cache_enabled, devices=(self.device,))
        self._frames.append((frame, saved, scope))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool:
        if self._overrides is None or not self._enabled:
            if self._stale.pop():
                torch.clear_autocast_cache()
            return super().__exit__(exc_type, exc_val, exc_tb)
        frame, saved, scope = self._frames.pop()
        try:
            regions.pop(frame, saved)
        finally:
            if scope is not None:
                scope.__exit__(exc_type, exc_val, exc_tb)
        return False


class _TableAutocast(autocast, _Unmanaged):
    """A region with ``cast_rules``. Derived from torch's unmanaged autocast so that dynamo
    traces its ``__enter__`` (which records mixprec's frame in the graph) instead of replaying
    it as a plain ``torch.autocast``."""
