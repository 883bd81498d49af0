"""The runs behind :func:`mixprec.numerics.tune`: the fp32 reference, one module's sensitivity, and
the error of a mixed-precision run against fp32.

Design: one object, :class:`_Tuner`, owns the model for the whole search and measures; the
search itself (which modules to try, in which order) lives in :mod:`mixprec.numerics.tuning`
and only reads the numbers. Every run fixes the RNG seed before the forward, so dropout matches
across runs, and clears the policies and gradients it set, so the model comes back as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec._core.engine import set_policy
from mixprec._core.policy import Policy
from mixprec.fp8.config import FP8Config
from mixprec.numerics.nonfinite_ops import iter_tensors
from mixprec.numerics.tune_plan import RunError
from mixprec.recipe import Recipe

_SCALES = (2.0**15, 2.0**10, 2.0**5, 1.0)


class _OwnOps(TorchDispatchMode):
    """Counts floating, non-view aten ops per innermost running module (forward only)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # An eager diagnostic: do not wrap __torch_dispatch__ in dynamo.disable (that costs a
        # one-time torch._dynamo import of several seconds and a wrapper call per op).
        return False

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            self.stack
            and not func.is_view
            and torch._C._current_graph_task_id() == -1
            and any(t.is_floating_point() for t in iter_tensors(out))
        ):
            self.counts[self.stack[-1]] = self.counts.get(self.stack[-1], 0) + 1
        return out


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if not bool(torch.isfinite(a).all()):
        return math.inf
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return num / den if den > 0 else num


def _first_float(obj: Any) -> Tensor | None:
    return next((t for t in iter_tensors(obj) if t.is_floating_point()), None)


class _Tuner:
    def __init__(
        self,
        model: nn.Module,
        batches: list[tuple[Any, Any]],
        loss_fn: Callable | None,
        dtype: torch.dtype,
        seed: int,
        metric: Callable[[Any, Any], Any] | None = None,
    ):
        self.model, self.batches, self.loss_fn = model, batches, loss_fn
        self.metric = metric
        self.dtype, self.seed = dtype, seed
        self.low = Policy(
            param_dtype=torch.float32, compute_dtype=dtype, output_dtype=torch.float32
        )
        self.fp32 = Policy("float32")
        self.named = dict(model.named_modules())
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.evaluations = 0

    def _output(self, x: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self.model(*x) if isinstance(x, tuple) else self.model(x)

    def _forward(self, batch: tuple[Any, Any]) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self._output(x), y)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return a scalar tensor, received {type(loss).__name__}"
                f"{'' if not isinstance(loss, Tensor) else list(loss.shape)}."
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "loss_fn returned a value that does not require grad (an accuracy-style "
                "function, or one computed under no_grad/detach): tune's default criterion "
                "compares gradients with fp32. To search by such a metric, pass it as "
                "metric=fn (higher is better) instead of loss_fn."
            )
        return loss.float().reshape(())

    @torch.no_grad()
    def _metric(self) -> float:
        """The metric averaged over the batches (NaN/inf if a batch's metric is not finite)."""
        values = []
        for x, y in self.batches:
            value = self.metric(self._output(x), y)
            try:
                values.append(float(value))
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"metric must return a number (or a 1-element tensor); received "
                    f"{type(value).__name__}."
                ) from None
        return sum(values) / len(values)

    def _grads(self) -> list[Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for _, p in self.params]

    def _zero(self) -> None:
        for _, p in self.params:
            p.grad = None

    def reference(self) -> list[str]:
        """fp32 losses, gradients, candidate outputs; returns the candidates."""
        stack: list[str] = []
        outs: dict[str, Tensor] = {}
        handles = self._record_outputs(stack, outs)
        self.ref_out: list[dict[str, Tensor]] = []
        self.ref_loss, self.ref_grads = [], []
        mode = _OwnOps(stack)
        try:
            if self.metric is not None:  # forward only; the metric's fp32 value is the reference
                self._reference_metric(mode, outs)
            else:
                self._reference_loss(mode, outs)
        finally:
            for h in handles:
                h.remove()
        return [p for p in self.named if mode.counts.get(p, 0) > 0]

    def _record_outputs(self, stack: list[str], outs: dict[str, Tensor]) -> list[Any]:
        """Hooks that keep the module path stack for ``_OwnOps`` and each module's first float
        output (into ``outs``, which the caller empties per batch); returns their handles."""
        paths = {id(m): n for n, m in self.named.items()}

        def pre(m: nn.Module, args: Any) -> None:
            stack.append(paths[id(m)])

        def post(m: nn.Module, args: Any, output: Any) -> None:
            stack.pop()
            t = _first_float(output)
            if t is not None:
                outs.setdefault(paths[id(m)], t.detach().float().clone())

        handles = []
        for m in self.named.values():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        return handles

    def _reference_metric(self, mode: _OwnOps, outs: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for x, _ in self.batches:
                outs.clear()
                with mode:
                    self._output(x)
                self.ref_out.append(dict(outs))
        self.ref_metric = self._metric()
        if not math.isfinite(self.ref_metric):
            raise ValueError(
                f"The fp32 metric is {self.ref_metric}: tune needs a metric "
                "that is finite on the fp32 model."
            )

    def _reference_loss(self, mode: _OwnOps, outs: dict[str, Tensor]) -> None:
        for batch in self.batches:
            outs.clear()
            with mode:
                loss = self._forward(batch)
            if not math.isfinite(loss.item()):
                raise ValueError(
                    f"The fp32 loss is {loss.item()}: tune needs a model that "
                    "trains in fp32 first (use mixprec.numerics.locate_nonfinite)."
                )
            self._zero()
            loss.backward()
            self.ref_loss.append(loss.item())
            self.ref_grads.append(self._grads())
            self.ref_out.append(dict(outs))
            self._zero()

    def _set(self, assignment: dict[str, Policy]) -> None:
        for path, pol in assignment.items():
            set_policy(self.named[path], pol)

    def _clear(self, assignment: dict[str, Policy]) -> None:
        for path in assignment:
            set_policy(self.named[path], None)

    def plan(self, fp32: list[str]) -> dict[str, Policy]:
        out = dict.fromkeys(fp32, self.fp32)
        for p in fp32:
            prefix = f"{p}." if p else ""
            for child, _ in self.named[p].named_children():
                cpath = prefix + child
                if cpath not in out:
                    out[cpath] = self.low
        return out

    @torch.no_grad()
    def sensitivity(self, path: str) -> float:
        module = self.named[path]
        assignment = {path: self.low}
        prefix = f"{path}." if path else ""
        for child, _ in module.named_children():
            assignment[prefix + child] = self.fp32
        captured: dict[str, Tensor] = {}

        def grab(m: nn.Module, args: Any, output: Any) -> None:
            t = _first_float(output)
            if t is not None and "y" not in captured:
                captured["y"] = t.detach().float()

        handle = module.register_forward_hook(grab, prepend=True)
        self._set(assignment)
        worst = 0.0
        try:
            for batch, ref in zip(self.batches, self.ref_out):
                captured.clear()
                x, _ = batch
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed)
                    self.model(*x) if isinstance(x, tuple) else self.model(x)
                if "y" in captured and path in ref:
                    worst = max(worst, _rel(captured["y"], ref[path]))
        finally:
            handle.remove()
            self._clear(assignment)
        return worst

    def evaluate(self, fp32: list[str], fp8: FP8Config | None = None) -> RunError:
        """The error against fp32 of a run with ``fp32`` kept in float32 (and ``fp8``)."""
        from mixprec._core.engine import autocast

        self.evaluations += 1
        assignment = self.plan(fp32)
        self._set(assignment)
        if self.metric is not None:
            try:
                with autocast(Recipe("O1", self.dtype, fp8=fp8)):
                    value = self._metric()
            finally:
                self._clear(assignment)
            return RunError(math.nan, math.nan, 1.0, value, self.ref_metric)
        try:
            return self._loss_run(fp8)
        finally:
            self._zero()
            self._clear(assignment)

    def _loss_run(self, fp8: FP8Config | None) -> RunError:
        """Loss and gradient errors, worst batch, of a run under the policies already set."""
        from mixprec._core.engine import autocast

        loss_err = grad_err = 0.0
        used = 1.0
        for i, batch in enumerate(self.batches):
            self._zero()
            with autocast(Recipe("O1", self.dtype, fp8=fp8)):
                loss = self._forward(batch)
            if not math.isfinite(loss.item()):
                return RunError(math.inf, math.inf, 1.0)
            loss_err = max(
                loss_err,
                abs(loss.item() - self.ref_loss[i]) / max(abs(self.ref_loss[i]), 1e-12),
            )
            err, scale = self._scaled_grad_error(loss, i)
            if scale is not None:
                used = scale
            grad_err = max(grad_err, err)
        return RunError(loss_err, grad_err, used)

    def _scaled_grad_error(self, loss: Tensor, i: int) -> tuple[float, float | None]:
        """Batch ``i``'s gradient error with the largest loss scale that keeps the gradients
        finite (fp16: 2**15 down to 1, as a dynamic scaler settles; else 1), and that scale
        (None: none did: the error is inf)."""
        scales = _SCALES if self.dtype == torch.float16 else (1.0,)
        for k, s in enumerate(scales):
            self._zero()
            (loss * s).backward(retain_graph=k + 1 < len(scales))
            grads = [
                None if p.grad is None else p.grad.detach().double() / s for _, p in self.params
            ]
            if all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                return _grad_error(grads, self.ref_grads[i]), s
        return math.inf, None


def _grad_error(grads: list[Tensor | None], ref: list[Tensor | None]) -> float:
    num = den = 0.0
    for g, r in zip(grads, ref):
        if r is None:
            continue
        r = r.double()
        g = torch.zeros_like(r) if g is None else g
        num += torch.linalg.vector_norm(g - r).item() ** 2
        den += torch.linalg.vector_norm(r).item() ** 2
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)
