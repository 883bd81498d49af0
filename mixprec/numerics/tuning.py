"""Automatic precision tuning: the fewest modules to keep in fp32 so training matches fp32.

``plan = mixprec.tune(model, (x, y), loss_fn, torch.float16, tolerance=0.05)`` then
``plan.apply(model)`` (or ``mixprec.set_policy`` per entry) and ``print(plan.explain())``.

Design (Intel Neural Compressor's accuracy-driven fallback and TE's per-layer statistics,
``docs/design.md``, "Numerics tools"; no AMP library tunes training precision):

1. **Reference.** One fp32 forward and backward per batch: the loss, every parameter gradient
   and every candidate module's output. Candidates are the modules that run floating-point ops
   *in their own forward* (leaves, and containers such as an attention block calling SDPA),
   found by watching the aten ops of the reference run.
2. **Sensitivity.** Each candidate alone runs in the low dtype -- its own ops only: its children
   are pinned to fp32 -- while the rest of the model stays fp32, so its inputs are exact. Its
   output's relative error against fp32 (inf if non-finite) ranks it.
3. **Search.** Everything low first (``mixprec.autocast``); if the loss and the gradients are
   within ``tolerance`` of fp32 (relative, worst batch), the plan is empty. Otherwise the most
   sensitive candidates are kept in fp32 one by one until the run passes, then each kept module
   is dropped again if the run still passes without it (an irreducible set: greedy plus
   pruning, not an exhaustive search, which is exponential). fp16 backward runs are scaled by
   the largest of 2**15, 2**10, 2**5, 1 that keeps the gradients finite, as a dynamic loss
   scaler would settle.
   With ``metric=`` the criterion is the user's metric instead (higher is better, e.g.
   accuracy): a run passes when its metric, averaged over the batches and computed under
   ``torch.no_grad``, is at most ``tolerance`` below the fp32 run's (an absolute drop, in the
   metric's units). Forward passes only: a metric has no gradient to compare.
4. **FP8** (``fp8=``). After the float32 search, the Linears the FP8 config selects (outside
   the kept modules) run their GEMMs in FP8 as well (``mixprec.autocast(fp8=...)``). If the run
   leaves the tolerance, the layers whose casts measured worst (lowest SQNR of input, weight or
   output gradient, from :func:`mixprec.fp8_plan` on the first batch) go back to 16 bits one by
   one until it passes, and each is then tried in FP8 again. Every Linear ends in FP8, 16 bits
   or float32, chosen against the same loss/gradient tolerance or the user's metric.
5. **Result.** A :class:`TunePlan` maps module paths to policies: ``"float32"`` for kept
   modules, and ``mixed_<dtype>`` for their direct children so that only the kept module's own
   ops leave 16-bit. :func:`mixprec.set_policy` accepts each entry; ``plan.apply(model)``
   applies them all; ``plan.fp8`` is the ``FP8Config`` for ``initialize(..., fp8=plan.fp8)``.
   ``plan.explain()`` says why each module was kept.

The model is restored exactly: parameters are never written, gradients and policies are put
back as they were.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.core.engine import set_policy
from mixprec.core.policy import Policy, get_policy
from mixprec.fp8.choice import FP8Choice, FP8Plan
from mixprec.fp8.config import FP8Config, as_fp8_config
from mixprec.fp8.gemm import layer_shape_ok
from mixprec.fp8.layers import candidates, unprepare
from mixprec.fp8.plan import fp8_plan
from mixprec.numerics.locate import iter_tensors

__all__ = ["TunePlan", "tune"]

_SCALES = (2.0**15, 2.0**10, 2.0**5, 1.0)
_BOUNDARY = "_mixprec_boundary"


@dataclass
class RunError:
    """How far one mixed-precision run is from fp32.

    Loss mode: relative loss and global-gradient errors, worst batch. Metric mode (``tune(...,
    metric=fn)``): ``metric`` is the run's mean metric over the batches and ``metric_ref`` the
    fp32 run's; ``loss`` and ``grad`` are NaN (not measured).
    """

    loss: float
    grad: float
    loss_scale: float
    metric: float | None = None
    metric_ref: float | None = None

    @property
    def metric_drop(self) -> float | None:
        """``metric_ref - metric`` (inf when the run's metric is not finite)."""
        if self.metric is None or self.metric_ref is None:
            return None
        return self.metric_ref - self.metric if math.isfinite(self.metric) else math.inf

    def within(self, tol: float) -> bool:
        drop = self.metric_drop
        if drop is not None:
            return drop <= tol
        return self.loss <= tol and self.grad <= tol

    def __str__(self) -> str:
        if self.metric_drop is not None:
            return (
                f"metric {self.metric:.4g} (fp32 {self.metric_ref:.4g}, drop "
                f"{self.metric_drop:.3g})"
            )
        return f"loss error {self.loss:.3g}, gradient error {self.grad:.3g}"


@dataclass
class TunePlan(Mapping):
    """Per-module policies found by :func:`tune`: a mapping ``path -> Policy``.

    Attributes:
        fp32_modules: the modules kept in float32, in the order they were chosen.
        sensitivity: each candidate's isolated output error in the low dtype (inf: non-finite).
        before, after: errors of the all-low run and of the tuned run.
        reasons: why each kept module was kept.
    """

    dtype: torch.dtype
    tolerance: float
    policies: dict[str, Policy]
    fp32_modules: list[str]
    sensitivity: dict[str, float]
    before: RunError
    after: RunError
    reasons: dict[str, str] = field(default_factory=dict)
    evaluations: int = 0
    fp8_modules: list[str] = field(default_factory=list)
    fp8_reasons: dict[str, str] = field(default_factory=dict)  # why a candidate stayed 16-bit
    fp8_recipe: str | None = None

    @property
    def fp8(self) -> FP8Config | None:
        """``fp8=`` for :func:`mixprec.initialize` running exactly :attr:`fp8_modules` in FP8
        (None when tune was not asked about FP8)."""
        if self.fp8_recipe is None:
            return None
        choices = {n: FP8Choice(n, True, "tune: within tolerance in FP8") for n in self.fp8_modules}
        choices.update({n: FP8Choice(n, False, r) for n, r in self.fp8_reasons.items()})
        return FP8Config(self.fp8_recipe, layers=FP8Plan(choices, self.fp8_recipe, None))

    def __getitem__(self, key: str) -> Policy:
        return self.policies[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    @property
    def passed(self) -> bool:
        return self.after.within(self.tolerance)

    def apply(self, model: nn.Module) -> nn.Module:
        """``set_policy`` every entry on ``model`` (paths are relative to it); returns it."""
        for path, policy in self.policies.items():
            set_policy(model.get_submodule(path), policy)
        return model

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "tolerance": self.tolerance,
            "policies": {p: str(pol) for p, pol in self.policies.items()},
            "fp32_modules": self.fp32_modules,
            "reasons": self.reasons,
            "sensitivity": {
                k: (v if math.isfinite(v) else "inf") for k, v in self.sensitivity.items()
            },
            "before": _plain(vars(self.before)),
            "after": _plain(vars(self.after)),
            "passed": self.passed,
            "evaluations": self.evaluations,
            "fp8_recipe": self.fp8_recipe,
            "fp8_modules": self.fp8_modules,
            "fp8_reasons": self.fp8_reasons,
        }

    def explain(self, top: int = 5) -> str:
        name = str(self.dtype).replace("torch.", "")
        lines = [
            f"tune ({name}, tolerance {self.tolerance:g}): all {name}: {self.before}; "
            f"tuned: {self.after} ({'within' if self.passed else 'NOT within'} "
            f"tolerance, {self.evaluations} evaluations)"
        ]
        if not self.fp32_modules:
            lines.append(f"  nothing needs float32: every module runs in {name}.")
        for m in self.fp32_modules:
            lines.append(f"  keep '{m or '<model>'}' in float32: {self.reasons[m]}")
        if self.fp8_recipe is not None:
            lines.append(f"  FP8 ({self.fp8_recipe}): {', '.join(self.fp8_modules) or 'no Linear'}")
            for m, why in self.fp8_reasons.items():
                lines.append(f"  keep '{m}' in {name} rather than FP8: {why}")
        ranked = sorted(self.sensitivity.items(), key=lambda kv: -kv[1])
        lines.append(
            "  most sensitive modules (isolated output error in "
            f"{name}): " + ", ".join(f"{p or '<model>'}={e:.3g}" for p, e in ranked[:top])
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


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
        paths = {id(m): n for n, m in self.named.items()}
        handles = []
        self.ref_out: list[dict[str, Tensor]] = []
        outs: dict[str, Tensor] = {}

        def pre(m: nn.Module, args: Any) -> None:
            stack.append(paths[id(m)])

        def post(m: nn.Module, args: Any, output: Any) -> None:
            stack.pop()
            t = _first_float(output)
            if t is not None:
                outs.setdefault(paths[id(m)], t.detach().float().clone())

        for m in self.named.values():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        self.ref_loss, self.ref_grads = [], []
        try:
            mode = _OwnOps(stack)
            if self.metric is not None:  # forward only; the metric's fp32 value is the reference
                with torch.no_grad():
                    for x, _ in self.batches:
                        outs = {}
                        with mode:
                            self._output(x)
                        self.ref_out.append(outs)
                self.ref_metric = self._metric()
                if not math.isfinite(self.ref_metric):
                    raise ValueError(
                        f"The fp32 metric is {self.ref_metric}: tune needs a metric "
                        "that is finite on the fp32 model."
                    )
                return [p for p in self.named if mode.counts.get(p, 0) > 0]
            for batch in self.batches:
                outs = {}
                with mode:
                    loss = self._forward(batch)
                if not math.isfinite(loss.item()):
                    raise ValueError(
                        f"The fp32 loss is {loss.item()}: tune needs a model that "
                        "trains in fp32 first (use mixprec.locate_nonfinite)."
                    )
                self._zero()
                loss.backward()
                self.ref_loss.append(loss.item())
                self.ref_grads.append(self._grads())
                self.ref_out.append(outs)
                self._zero()
        finally:
            for h in handles:
                h.remove()
        return [p for p in self.named if mode.counts.get(p, 0) > 0]

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
        from mixprec.core.engine import autocast

        self.evaluations += 1
        assignment = self.plan(fp32)
        self._set(assignment)
        if self.metric is not None:
            try:
                with autocast(self.dtype, fp8=fp8):
                    value = self._metric()
            finally:
                self._clear(assignment)
            return RunError(math.nan, math.nan, 1.0, value, self.ref_metric)
        loss_err = grad_err = 0.0
        used = 1.0
        try:
            for i, batch in enumerate(self.batches):
                self._zero()
                with autocast(self.dtype, fp8=fp8):
                    loss = self._forward(batch)
                if not math.isfinite(loss.item()):
                    return RunError(math.inf, math.inf, 1.0)
                loss_err = max(
                    loss_err,
                    abs(loss.item() - self.ref_loss[i]) / max(abs(self.ref_loss[i]), 1e-12),
                )
                scales = _SCALES if self.dtype == torch.float16 else (1.0,)
                err = math.inf
                for k, s in enumerate(scales):
                    self._zero()
                    (loss * s).backward(retain_graph=k + 1 < len(scales))
                    grads = [
                        None if p.grad is None else p.grad.detach().double() / s
                        for _, p in self.params
                    ]
                    if all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                        err = _grad_error(grads, self.ref_grads[i])
                        used = s
                        break
                grad_err = max(grad_err, err)
            return RunError(loss_err, grad_err, used)
        finally:
            self._zero()
            self._clear(assignment)


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


def _as_batches(batch: Any) -> list[tuple[Any, Any]]:
    items = batch if isinstance(batch, list) else [batch]
    out = []
    for b in items:
        if not (isinstance(b, tuple) and len(b) == 2):
            raise TypeError(
                "tune expects batch=(inputs, target) -- inputs a tensor or a tuple of "
                "model arguments -- or a list of such pairs; received "
                f"{type(b).__name__}{'' if not isinstance(b, tuple) else len(b)}."
            )
        out.append(b)
    if not out:
        raise ValueError("tune needs at least one batch.")
    return out


def tune(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    dtype: torch.dtype | str = torch.float16,
    tolerance: float = 0.05,
    *,
    metric: Callable[[Any, Any], Any] | None = None,
    candidates: list[str] | None = None,
    max_evaluations: int = 64,
    seed: int = 0,
    fp8: bool | str | FP8Config | None = None,
) -> TunePlan:
    """Find the fewest modules to keep in float32 so loss and gradients (or a metric) match fp32.

    Args:
        model: an fp32 model not yet passed to :func:`mixprec.initialize`.
        batch: ``(inputs, target)`` or a list of them (real data); ``inputs`` is a tensor or a
            tuple of positional arguments. The loss is ``loss_fn(model(inputs), target)``.
        loss_fn: returns a scalar loss that requires grad; the search compares loss and
            gradients with fp32. Give ``loss_fn`` or ``metric``, not both.
        dtype: the 16-bit compute dtype to tune for.
        tolerance: with ``loss_fn``, the largest relative error of the loss and of the global
            gradient (each, worst batch) accepted against fp32; with ``metric``, the largest
            drop of the metric (absolute, in its units, e.g. 0.01 = one accuracy point)
            below fp32's.
        metric: ``metric(model(inputs), target) -> number``, **higher is better** (accuracy,
            F1, BLEU, negated error ...). Evaluated under ``torch.no_grad``, averaged over the
            batches; the search then keeps modules in fp32 until the 16-bit run's metric is
            within ``tolerance`` of the fp32 run's. No backward pass is run. Example::

                def accuracy(logits, y):
                    return (logits.argmax(-1) == y).float().mean()

                plan = mixprec.tune(model, batches, metric=accuracy, tolerance=0.01)
        candidates: module paths to choose from (default: every module running its own ops).
        max_evaluations: cap on full forward/backward evaluations in the search.
        seed: RNG seed set before every forward, so dropout matches across runs.
        fp8: also choose which Linears run their GEMMs in FP8 (True, a recipe name or an
            :class:`mixprec.FP8Config`; its ``layers`` gives the candidates -- ``"auto"``: the
            ones :func:`mixprec.fp8_plan` chooses on the first batch, ``"all"``: every eligible
            Linear -- and the search keeps those the tolerance allows). See ``plan.fp8``.

    Returns:
        A :class:`TunePlan` (a ``path -> Policy`` mapping with ``apply`` and ``explain``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"tune expects an nn.Module, received {type(model).__name__}.")
    if model.__dict__.get("_mixprec_initialized") or _BOUNDARY in model.__dict__:
        raise RuntimeError(
            "tune runs on the plain fp32 model: call it before mixprec.initialize "
            "and apply the plan (plan.apply(model)) before initialize."
        )
    if not isinstance(dtype, torch.dtype):
        dtype = Policy(compute_dtype=dtype).compute_dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"tune needs a 16-bit dtype (torch.float16 or torch.bfloat16), received {dtype}."
        )
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number, received {tolerance!r}.")
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"tune compares against fp32 and needs fp32 parameters; {bad[:3]} are not float32."
        )
    if (loss_fn is None) == (metric is None):
        raise ValueError(
            "tune needs loss_fn (search by loss and gradient error) or metric= "
            "(search by your higher-is-better metric, e.g. accuracy), one of "
            f"them; received {'both' if metric is not None else 'neither'}."
        )
    for name, fn in (("loss_fn", loss_fn), ("metric", metric)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name} must be callable(outputs, target); received {type(fn).__name__}."
            )
    batches = _as_batches(batch)
    fp8_cfg = as_fp8_config(fp8)
    saved_policies = {n: get_policy(m) for n, m in model.named_modules()}
    saved_grads = [(p, p.grad) for p in model.parameters()]
    tuner = _Tuner(model, batches, loss_fn, dtype, seed, metric)
    for n, m in model.named_modules():
        if saved_policies[n] is not None:
            set_policy(m, None)
    try:
        found = tuner.reference()
        if candidates is not None:
            unknown = [c for c in candidates if c not in tuner.named]
            if unknown:
                raise ValueError(f"Unknown candidate module(s) {unknown}.")
            found = list(candidates)
        sens = {p: tuner.sensitivity(p) for p in found}
        before = tuner.evaluate([])
        chosen: list[str] = []
        current = before
        order = sorted(found, key=lambda p: -sens[p])
        for path in order:
            if current.within(tolerance) or tuner.evaluations >= max_evaluations:
                break
            chosen.append(path)
            current = tuner.evaluate(chosen)
        reasons: dict[str, str] = {}
        if current.within(tolerance):
            for path in sorted(chosen, key=lambda p: sens[p]):  # least sensitive first
                if tuner.evaluations >= max_evaluations:
                    break
                rest = [c for c in chosen if c != path]
                without = tuner.evaluate(rest)
                if without.within(tolerance):
                    chosen, current = rest, without
                else:
                    what = (
                        ("its output is non-finite in " + _name(dtype))
                        if math.isinf(sens[path])
                        else f"its {_name(dtype)} output differs from fp32 by {sens[path]:.3g}"
                    )
                    reasons[path] = f"{what}; without it: {without} (tolerance {tolerance:g})"
        for path in chosen:
            reasons.setdefault(
                path,
                f"isolated output error {sens[path]:.3g}; the search "
                "stopped before checking whether it can be dropped",
            )
        fp8_modules: list[str] = []
        fp8_reasons: dict[str, str] = {}
        if fp8_cfg is not None:
            fp8_modules, fp8_reasons, current = _tune_fp8(
                tuner, fp8_cfg, chosen, current, tolerance, max_evaluations
            )
        return TunePlan(
            dtype,
            float(tolerance),
            tuner.plan(chosen),
            chosen,
            sens,
            before,
            current,
            reasons,
            tuner.evaluations,
            fp8_modules,
            fp8_reasons,
            None if fp8_cfg is None else fp8_cfg.recipe,
        )
    finally:
        unprepare(model)  # autocast(fp8=...) gave its Linears FP8 forwards
        for n, m in model.named_modules():
            set_policy(m, saved_policies[n])
        for p, g in saved_grads:
            p.grad = g


def _tune_fp8(
    tuner: _Tuner,
    cfg: FP8Config,
    fp32: list[str],
    current: RunError,
    tolerance: float,
    max_evaluations: int,
) -> tuple[list[str], dict[str, str], RunError]:
    """The FP8 stage of :func:`tune` (module docstring, step 4): (FP8 layers, why the other
    candidates stay 16-bit, the final run's error)."""
    x, y = tuner.batches[0]
    loss_fn = None if tuner.loss_fn is None else (lambda out: tuner.loss_fn(out, y))
    plan = fp8_plan(tuner.model, x if isinstance(x, tuple) else (x,), config=cfg, loss_fn=loss_fn)
    linears, left_out = candidates(tuner.model)
    reasons: dict[str, str] = {}
    pool: list[str] = []
    for name, m in linears:
        if any(not k or name == k or name.startswith(f"{k}.") for k in fp32):
            continue  # float32 (or a kept module's own 16-bit child): not an FP8 candidate
        bad = layer_shape_ok(m.in_features, m.out_features)
        if isinstance(cfg.layers, str):
            wanted = plan[name].fp8 if cfg.layers == "auto" else name not in left_out and not bad
            why = plan[name].reason if cfg.layers == "auto" else left_out.get(name, bad)
        else:
            wanted = bool(cfg.layers(name, m)) and not bad
            why = bad or "not selected by the layers= predicate"
        if wanted:
            pool.append(name)
        elif why:
            reasons[name] = why

    def config(layers: list[str]) -> FP8Config:
        chosen = frozenset(layers)
        return dataclasses.replace(cfg, layers=lambda name, module: name in chosen)

    def worst_sqnr(name: str) -> float:
        c = plan[name]
        return min(s.sqnr for s in (c.input, c.weight, c.grad) if s is not None)

    if not pool:
        return [], reasons, current
    run = tuner.evaluate(fp32, config(pool))
    fp8 = list(pool)
    dropped: list[str] = []
    for name in sorted(pool, key=worst_sqnr):  # worst casts leave FP8 first
        if run.within(tolerance) or tuner.evaluations >= max_evaluations:
            break
        fp8.remove(name)
        dropped.append(name)
        run = tuner.evaluate(fp32, config(fp8))
    if run.within(tolerance):
        for name in sorted(dropped, key=worst_sqnr, reverse=True):  # best casts back first
            if tuner.evaluations >= max_evaluations:
                break
            again = tuner.evaluate(fp32, config([*fp8, name]))
            if again.within(tolerance):
                fp8.append(name)
                run = again
            else:
                reasons[name] = f"in FP8: {again} (tolerance {tolerance:g})"
    for name in dropped:
        reasons.setdefault(name, "left FP8 while searching; the search stopped there")
    order = {name: i for i, (name, _) in enumerate(linears)}
    return sorted(fp8, key=order.__getitem__), reasons, run


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe numbers: NaN (not measured) -> None, inf -> "inf"."""
    return {
        k: (
            None
            if isinstance(v, float) and math.isnan(v)
            else "inf"
            if isinstance(v, float) and math.isinf(v)
            else v
        )
        for k, v in values.items()
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
