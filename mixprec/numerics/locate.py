"""Find the first inf/NaN: which module, which op, which step, forward or backward.

``with mixprec.numerics.locate_nonfinite(model, opt) as loc: ...train...`` then
``print(loc.report())``.

Design (``docs/design.md``, "Numerics tools"):

* **Where it looks.** A ``TorchDispatchMode`` sees every aten op that actually runs -- after
  torch.autocast and mixprec's casts, and *inside backward*, where module hooks see nothing.
  Each floating output is checked with one fp32-accumulated ``sum`` (a finite sum proves every
  element finite; a non-finite sum is confirmed with ``isfinite``), so the cost when nothing
  goes wrong is one read of each op's output (measured in ``docs/numerics.md``). View ops are
  skipped: they cannot create a non-finite value. An op counts as the *producer* only if its
  floating inputs were finite (or it made a NaN from inputs without one), and ops given a
  ``-inf`` scalar are intentional masks (``masked_fill(-inf)``), so causal-attention masks and
  the ops that carry them are not reported. The model's own inputs are checked at entry.
  Per-op (not per-module) checking is what names the op, and it is what Paddle's tensor
  checker does; HF's ``DebugUnderflowOverflow`` only sees module outputs, never the backward.
* **Which module.** Forward: module pre/post hooks keep a path stack. Backward: the forward
  post-hook of every module tags the autograd nodes its forward created (those with a sequence
  number taken after its pre-hook; inner modules tag first, so the innermost module wins);
  during backward ``torch._C._current_autograd_node()`` names the node running, and its tag
  names the module. Gradient accumulation into a parameter is attributed to its owner.
* **Which step.** Step ``k`` is the ``k``-th forward of the watched model with grad enabled
  (0-based; micro-batches count separately); the backward belongs to the forward before it.
  Only the *first* non-finite value of each step is recorded (the rest are consequences), and
  checking pauses until the next step.
* **Expected or error.** With a loss-scaling :class:`MixedPrecisionOptimizer`, an inf produced
  from finite inputs in a 16-bit op during backward is the overflow the dynamic scaler exists
  for: the step is skipped and the scale lowered, so it is reported as ``expected``. Anything
  else -- a NaN, an inf in forward, any non-finite value in float32 -- is an ``error``.
  ``raise_on="error"`` (or ``"any"``) raises :class:`NonFiniteError` at the op itself, with the
  Python stack of the failing forward op, before the value spreads.

Diagnostics never change numerics: the locator only reads tensors and sets autograd-node
metadata.

This module holds the locator (dispatch mode, module hooks, where and which step); the per-op
checks live in :mod:`~mixprec.numerics.nonfinite_ops` and the recorded events with their
verdicts in :mod:`~mixprec.numerics.nonfinite_event`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.fp8.layers import layers_of
from mixprec.numerics.nonfinite_event import (
    NonFiniteError,
    NonFiniteEvent,
    TensorStats,
    _classify,
)
from mixprec.numerics.nonfinite_ops import (
    _INFO,
    _checkable,
    _op_info,
    _produced_here,
    has_nonfinite,
    iter_tensors,
)

__all__ = [
    "NonFiniteError",
    "NonFiniteEvent",
    "NonFiniteLocator",
    "TensorStats",
    "locate_nonfinite",
]

_TAG = "mixprec_module"
_RAISE_ON = (None, "error", "any")


class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # An eager diagnostic: do not wrap __torch_dispatch__ in dynamo.disable (that costs a
        # one-time torch._dynamo import of several seconds and a wrapper call per op).
        return False

    def __init__(self, locator: NonFiniteLocator):
        super().__init__()
        self.locator = locator

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        loc = self.locator
        if not loc._armed:
            return func(*args, **kwargs)
        info = _INFO.get(func)
        if info is None:
            info = _INFO[func] = _op_info(func)
        skip, written = info
        if skip:
            return func(*args, **kwargs)
        # an in-place op overwrites its input: judge that input before it is gone
        before = bool(written) and any(
            has_nonfinite(t)
            for i, name in written
            for t in iter_tensors(args[i] if i < len(args) else kwargs.get(name))
            if _checkable(t)
        )
        out = func(*args, **kwargs)
        for t in iter_tensors(out):
            if _checkable(t) and has_nonfinite(t):
                if not before and _produced_here(func, args, kwargs, t, written):
                    loc._found(func, args, kwargs, t)
                break
        return out


class NonFiniteLocator:
    """Watch a model's forward and backward for the first inf/NaN of each step.

    Args:
        model: the module whose forward is watched (its submodules name the culprit).
        optimizer: optional; a :class:`mixprec._core.optimizer.MixedPrecisionOptimizer` or a
            ``mixprec.amp.GradScaler`` makes gradient overflows under loss scaling ``expected``
            and records whether the step was skipped.
        raise_on: ``None`` (record only), ``"error"`` or ``"any"``: raise
            :class:`NonFiniteError` right at the op.
        max_events: stop recording after this many steps with a non-finite value.

    Use as a context manager around the training loop (forward, backward, step); see
    :func:`locate_nonfinite`. ``events`` holds one :class:`NonFiniteEvent` per bad step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        raise_on: str | None = None,
        max_events: int = 100,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"locate_nonfinite expects an nn.Module, received {type(model).__name__}."
            )
        if raise_on not in _RAISE_ON:
            raise ValueError(f"raise_on={raise_on!r} is not one of {_RAISE_ON}.")
        self.model = model
        self.optimizer = optimizer
        self.raise_on = raise_on
        self.max_events = max_events
        self.events: list[NonFiniteEvent] = []
        self.step = -1
        self._armed = True
        self._paths = {id(m): name for name, m in model.named_modules()}
        self._params = {id(p): name for name, p in model.named_parameters()}
        self._stack: list[tuple[str, int]] = []
        self._handles: list[Any] = []
        self._mode: _Mode | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> NonFiniteLocator:
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, prepend=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        self._note_skip()

    @property
    def first(self) -> NonFiniteEvent | None:
        """The first recorded event, or None."""
        return self.events[0] if self.events else None

    def errors(self) -> list[NonFiniteEvent]:
        return [e for e in self.events if e.severity == "error"]

    def report(self) -> str:
        """A readable summary of every recorded event."""
        if not self.events:
            return f"no inf/NaN in {self.step + 1} step(s)"
        head = (
            f"{len(self.events)} step(s) with inf/NaN in {self.step + 1} step(s) "
            f"({len(self.errors())} error(s)):"
        )
        return "\n".join([head, *(str(e) for e in self.events)])

    # -- hooks -------------------------------------------------------------------------------
    def _note_skip(self) -> None:
        opt = self.optimizer
        last = self.events[-1] if self.events else None
        if (
            last
            and last.step == self.step
            and hasattr(opt, "step_skipped")
            and last.step_skipped is None
        ):
            self.events[-1].step_skipped = bool(opt.step_skipped)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not self._stack and torch.is_grad_enabled():
            self._note_skip()
            self.step += 1
            self._armed = len(self.events) < self.max_events
        if not self._stack and self._armed:
            bad = next((t for t in iter_tensors(args) if _checkable(t) and has_nonfinite(t)), None)
            if bad is not None:
                self._input_event(bad)
        path = self._paths.get(id(module), "?")
        last = self.events[-1] if self.events else None
        # a non-finite value on its way into an FP8 layer: its cast turns the slice NaN (a
        # saturating cast would hide it as 448): say which FP8 layers it reached
        if (
            last is not None
            and last.step == self.step
            and self._is_fp8(path)
            and any(_checkable(t) and has_nonfinite(t) for t in iter_tensors(args))
        ):
            last.fp8_reached.append(path)
        seq = torch._C._autograd._get_sequence_nr()
        self._stack.append((path, seq))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        path, start = self._stack.pop()
        if torch.is_grad_enabled():
            _tag_graph(output, path, start)

    def _is_fp8(self, path: str) -> bool:
        """Is ``path`` a Linear running in FP8 (given fp8= by initialize or autocast)?"""
        layer = layers_of(self.model).get(path)
        return layer is not None and layer.active

    # -- detection ---------------------------------------------------------------------------
    def _where(self) -> tuple[str, str, str | None]:
        if torch._C._current_graph_task_id() == -1:
            return "forward", (self._stack[-1][0] if self._stack else "<outside the model>"), None
        node = torch._C._current_autograd_node()
        if node is None:
            return "backward", "<unknown>", None
        name = node.name()
        var = getattr(node, "variable", None)
        if var is not None:
            pname = self._params.get(id(var))
            if pname is None:
                return "backward", "<outside the model>", name
            return "backward", pname.rpartition(".")[0], f"{name} ({pname})"
        return "backward", node.metadata.get(_TAG, "<outside the model>"), name

    def _found(self, func: Any, args: tuple, kwargs: dict, out: Tensor) -> None:
        self._armed = False  # the first one only: the rest of this step are consequences
        phase, module, node = self._where()
        inputs = [TensorStats.of(t) for t in iter_tensors((args, kwargs)) if _checkable(t)]
        ostats = TensorStats.of(out)
        kind = "+".join(k for k, n in (("inf", ostats.num_inf), ("nan", ostats.num_nan)) if n)
        scale = self._loss_scale()
        severity, reason = _classify(phase, module, out.dtype, kind, inputs, scale)
        fp8 = layers_of(self.model)[module].recipe.name if self._is_fp8(module) else None
        if fp8 is not None:
            reason += (
                f" '{module}' runs its GEMMs in FP8 ({fp8}): its casts turn a non-finite "
                "slice into NaN rather than saturating it to 448, so the step is skipped "
                "instead of training on a clipped value."
            )
        stack: list[str] = []
        if phase == "forward" and (
            self.raise_on == "any" or (self.raise_on == "error" and severity == "error")
        ):
            import traceback

            stack = traceback.format_stack()[:-3]
        event = NonFiniteEvent(
            self.step,
            phase,
            module,
            str(func),
            node,
            str(out.dtype).replace("torch.", ""),
            kind,
            ostats,
            inputs,
            severity,
            reason,
            scale,
            stack=stack,
            fp8=fp8,
        )
        self.events.append(event)
        if self.raise_on == "any" or (self.raise_on == "error" and severity == "error"):
            raise NonFiniteError(event)

    def _input_event(self, t: Tensor) -> None:
        self._armed = False
        stats = TensorStats.of(t)
        kind = "+".join(k for k, n in (("inf", stats.num_inf), ("nan", stats.num_nan)) if n)
        event = NonFiniteEvent(
            self.step,
            "forward",
            "",
            "<model input>",
            None,
            stats.dtype,
            kind,
            stats,
            [],
            "error",
            "The model's input already holds inf/NaN: check the data pipeline.",
            self._loss_scale(),
        )
        self.events.append(event)
        if self.raise_on is not None:
            raise NonFiniteError(event)

    def _loss_scale(self) -> float | None:
        opt = self.optimizer
        if opt is not None and hasattr(opt, "slots"):  # MixedPrecisionOptimizer
            return float(opt.loss_scale)
        if callable(getattr(opt, "get_scale", None)) and opt.is_enabled():  # a GradScaler
            return float(opt.get_scale())
        return None


def _tag_graph(output: Any, path: str, start: int) -> None:
    """Tag the autograd nodes created since sequence number ``start`` with ``path``."""
    todo = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        seq = node._sequence_nr()
        if seq in seen:
            continue
        seen.add(seq)
        meta = node.metadata
        if _TAG not in meta:
            meta[_TAG] = path
        for nxt, _ in node.next_functions:
            if nxt is not None and not hasattr(nxt, "variable") and nxt._sequence_nr() >= start:
                todo.append(nxt)


def locate_nonfinite(
    model: nn.Module, optimizer: Any = None, *, raise_on: str | None = None, max_events: int = 100
) -> NonFiniteLocator:
    """Context manager: find the first inf/NaN (module, op, step) in forward and backward.

    Example::

        with mixprec.numerics.locate_nonfinite(model, opt, raise_on="error") as loc:
            for x, y in data:
                opt.backward(loss_fn(model(x), y)); opt.step(); opt.zero_grad()
        print(loc.report())
    """
    return NonFiniteLocator(model, optimizer, raise_on=raise_on, max_events=max_events)
