"""Automatic precision tuning: the fewest modules to keep in fp32 so training matches fp32.

``plan = mixprec.numerics.tune(model, (x, y), loss_fn, torch.float16, tolerance=0.05)`` then
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
   output gradient, from :func:`mixprec.fp8.fp8_plan` on the first batch) go back to 16 bits one by
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
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mixprec._core.engine import set_policy
from mixprec._core.policy import Policy, get_policy
from mixprec.fp8.config import FP8Config
from mixprec.fp8.gemm import layer_shape_ok
from mixprec.fp8.layers import candidates, unprepare
from mixprec.fp8.plan import fp8_plan
from mixprec.numerics._tuner import _Tuner
from mixprec.numerics.tune_plan import RunError, TunePlan
from mixprec.recipe import level_recipe

__all__ = ["TunePlan", "tune"]

_BOUNDARY = "_mixprec_boundary"


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
    recipe: Any = torch.float16,
    tolerance: float = 0.05,
    *,
    metric: Callable[[Any, Any], Any] | None = None,
    candidates: list[str] | None = None,
    max_evaluations: int = 64,
    seed: int = 0,
) -> TunePlan:
    """Find the fewest modules to keep in float32 so loss and gradients (or a metric) match fp32.

    Args:
        model: an fp32 model not yet passed to :func:`mixprec.initialize`.
        batch: ``(inputs, target)`` or a list of them (real data); ``inputs`` is a tensor or a
            tuple of positional arguments. The loss is ``loss_fn(model(inputs), target)``.
        loss_fn: returns a scalar loss that requires grad; the search compares loss and
            gradients with fp32. Give ``loss_fn`` or ``metric``, not both.
        recipe: the 16-bit dtype to tune for, or a :class:`mixprec.Recipe`: its dtype, and
            with its ``fp8`` the search also chooses which Linears run their GEMMs in FP8 (the
            FP8 config's ``layers`` gives the candidates -- ``"auto"``: the ones
            :func:`mixprec.fp8.fp8_plan` chooses on the first batch, ``"all"``: every eligible
            Linear -- and the search keeps those the tolerance allows; see ``plan.fp8``).
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

                plan = mixprec.numerics.tune(model, batches, metric=accuracy, tolerance=0.01)
        candidates: module paths to choose from (default: every module running its own ops).
        max_evaluations: cap on full forward/backward evaluations in the search.
        seed: RNG seed set before every forward, so dropout matches across runs.

    Returns:
        A :class:`TunePlan` (a ``path -> Policy`` mapping with ``apply`` and ``explain``).
    """
    _check_model(model)
    dtype, fp8 = _dtype_and_fp8(recipe)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"tune needs a 16-bit dtype (torch.float16 or torch.bfloat16), received {dtype}."
        )
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number, received {tolerance!r}.")
    _check_params_fp32(model)
    _check_criterion(loss_fn, metric)
    batches = _as_batches(batch)
    tuner = _Tuner(model, batches, loss_fn, dtype, seed, metric)
    return _tune(tuner, tolerance, candidates, max_evaluations, fp8)


def _dtype_and_fp8(spec: Any) -> tuple[torch.dtype, FP8Config | None]:
    """The dtype to tune for and the FP8 config to choose layers for, from a dtype (or its
    name) or a Recipe."""
    recipe = level_recipe(spec)
    if recipe is not None:
        return recipe.resolved_dtype(), recipe.fp8
    if isinstance(spec, torch.dtype):
        return spec, None
    return Policy(compute_dtype=spec).compute_dtype, None


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"tune expects an nn.Module, received {type(model).__name__}.")
    if model.__dict__.get("_mixprec_initialized") or _BOUNDARY in model.__dict__:
        raise RuntimeError(
            "tune runs on the plain fp32 model: call it before mixprec.initialize "
            "and apply the plan (plan.apply(model)) before initialize."
        )


def _check_params_fp32(model: nn.Module) -> None:
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"tune compares against fp32 and needs fp32 parameters; {bad[:3]} are not float32."
        )


def _check_criterion(loss_fn: Callable | None, metric: Callable | None) -> None:
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


def _tune(
    tuner: _Tuner,
    tolerance: float,
    paths: list[str] | None,
    max_evaluations: int,
    fp8_cfg: FP8Config | None,
) -> TunePlan:
    """The search (module docstring, steps 1-5) on a model whose policies are lifted for its
    duration; policies, gradients and FP8 forwards are put back as they were."""
    model = tuner.model
    saved_policies = {n: get_policy(m) for n, m in model.named_modules()}
    saved_grads = [(p, p.grad) for p in model.parameters()]
    for n, m in model.named_modules():
        if saved_policies[n] is not None:
            set_policy(m, None)
    try:
        found = tuner.reference()
        if paths is not None:
            unknown = [c for c in paths if c not in tuner.named]
            if unknown:
                raise ValueError(f"Unknown candidate module(s) {unknown}.")
            found = list(paths)
        sens = {p: tuner.sensitivity(p) for p in found}
        before = tuner.evaluate([])
        chosen, current = _keep_most_sensitive(
            tuner, found, sens, before, tolerance, max_evaluations
        )
        reasons: dict[str, str] = {}
        if current.within(tolerance):
            chosen, current = _drop_unneeded(
                tuner, sens, chosen, current, tolerance, max_evaluations, reasons
            )
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
            tuner.dtype,
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


def _keep_most_sensitive(
    tuner: _Tuner,
    found: list[str],
    sens: dict[str, float],
    before: RunError,
    tolerance: float,
    max_evaluations: int,
) -> tuple[list[str], RunError]:
    """Greedy: keep the most sensitive candidates in float32, one by one, until the run passes
    (or the evaluations run out); returns them and the last run's error."""
    chosen: list[str] = []
    current = before
    for path in sorted(found, key=lambda p: -sens[p]):
        if current.within(tolerance) or tuner.evaluations >= max_evaluations:
            break
        chosen.append(path)
        current = tuner.evaluate(chosen)
    return chosen, current


def _drop_unneeded(
    tuner: _Tuner,
    sens: dict[str, float],
    chosen: list[str],
    current: RunError,
    tolerance: float,
    max_evaluations: int,
    reasons: dict[str, str],
) -> tuple[list[str], RunError]:
    """Pruning: drop each kept module, least sensitive first, if the run still passes without
    it; ``reasons`` gets why each remaining one stays."""
    dtype = tuner.dtype
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
    return chosen, current


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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
