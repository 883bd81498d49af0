"""``mixprec report``: lint, op stats, range audit, locator and tune on one model.

``mixprec report`` runs on a small built-in GPT; ``mixprec report my_pkg.models:make`` on a
user's model, where ``make()`` returns ``model``, ``(model, batch)`` or
``(model, batch, loss_fn)`` with ``batch = (inputs, target)``. Without a batch only the lint
runs (the other tools need data). Integer targets get cross-entropy, float targets MSE.

The model given is never trained: op stats and the range audit run one forward/backward on it
(gradients are cleared after), the locator trains a deep copy for ``--steps`` steps through
``mixprec.initialize`` at O2, and ``--tune`` searches on another copy. With ``--fp8`` the plan
of :func:`mixprec.fp8.fp8_plan` is printed first (each Linear's choice and why), op stats run
under ``autocast(Recipe(..., fp8=...))`` on a copy (the scaled matmuls in the ``fp8`` column), a
second range audit judges the FP8 layers at their recipe's scales, and the locator trains with
the recipe's ``fp8``.
Results go to the terminal, to ``OUT/report.json`` and to PNG histograms in ``OUT``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.fp8.config import FP8Config

__all__ = ["add_parser", "builtin_model", "load_factory", "run_report"]


def builtin_model(seed: int = 0) -> tuple[nn.Module, tuple[Tensor, Tensor], Callable]:
    """A 2-layer character GPT (width 128, context 64) and one batch of 8 random sequences."""
    from mixprec.bench.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128))
    tokens = torch.randint(0, 96, (8, 65))
    return model, (tokens[:, :-1], tokens[:, 1:]), _default_loss


def _default_loss(out: Tensor, target: Tensor) -> Tensor:
    if target.is_floating_point():
        return F.mse_loss(out.float(), target.float())
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def load_factory(spec: str) -> tuple[nn.Module, Any, Callable | None]:
    """Import ``module:factory``, call it, and normalise its result.

    The module is searched in the current folder first, then on ``sys.path``, as
    ``python -m`` does: the ``mixprec`` console script does not put the current folder on
    ``sys.path`` by itself, so it is added (and stays, for the factory's own imports).
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"Expected MODEL as 'module:factory' (e.g. 'my_pkg.models:make'), received {spec!r}."
        )
    cwd = os.getcwd()
    if cwd not in (os.path.abspath(p) for p in sys.path):  # abspath("") is the current folder
        sys.path.insert(0, cwd)
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"Cannot load {spec!r}: {e}. The module must be importable (on "
            "PYTHONPATH or in the current folder)."
        ) from e
    result = factory()
    if isinstance(result, nn.Module):
        return result, None, None
    if isinstance(result, tuple) and 2 <= len(result) <= 3 and isinstance(result[0], nn.Module):
        return result[0], result[1], (result[2] if len(result) == 3 else _default_loss)
    raise TypeError(
        f"{spec}() must return a model, (model, batch) or (model, batch, loss_fn); "
        f"received {type(result).__name__}."
    )


def _forward(model: nn.Module, x: Any) -> Any:
    return model(*x) if isinstance(x, tuple) else model(x)


def _shape_hints(x: Any) -> tuple[int | None, int | None]:
    t = x[0] if isinstance(x, tuple) else x
    if not isinstance(t, Tensor) or t.dim() == 0:
        return None, None
    seq = int(t.shape[1]) if t.dim() >= 2 and not t.is_floating_point() else None
    return int(t.shape[0]), seq


def run_report(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable | None,
    *,
    dtype: torch.dtype,
    steps: int = 3,
    target: str = "gpu",
    do_tune: bool = False,
    tolerance: float = 0.05,
    out: pathlib.Path | None = None,
    plots: bool = True,
    fp8: Any = None,
) -> dict[str, Any]:
    """Run every tool; print sections; return the JSON-ready report (and write files).

    ``fp8``: None, or what ``fp8=`` takes (True, a recipe name, an ``FP8Config``).
    """
    from mixprec.fp8.config import as_fp8_config

    fp8 = as_fp8_config(fp8)
    doc: dict[str, Any] = {
        "model": type(model).__name__,
        "dtype": str(dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    doc["lint"] = _lint_section(model, batch, dtype, target)
    if batch is None:
        print(
            "no batch: op stats, range audit, locator and tune need (model, batch) from the "
            "factory."
        )
        return doc
    x, _ = batch
    loss_fn = loss_fn or _default_loss
    if fp8 is not None:
        fp8 = _fp8_plan_section(model, x, fp8, doc)

    saved = [(p, p.grad) for p in model.parameters()]
    observed = copy.deepcopy(model) if fp8 is not None else model  # FP8 leaves no trace
    _op_stats_section(observed, batch, loss_fn, dtype, fp8, doc)
    audit = _range_section(model, batch, loss_fn, saved, doc)
    if fp8 is not None:
        _fp8_range_section(observed, batch, loss_fn, dtype, fp8, doc)
    del observed

    _locator_section(model, batch, loss_fn, dtype, steps, fp8, doc)
    if do_tune:
        from mixprec.numerics.tuning import tune

        plan = tune(copy.deepcopy(model), batch, loss_fn, dtype, tolerance)
        print()
        print(plan.explain())
        doc["tune"] = plan.as_dict()
    if out is not None:
        doc["files"] = _write_files(out, doc, audit if plots else None)
    return doc


def _lint_section(model: nn.Module, batch: Any, dtype: torch.dtype, target: str) -> dict:
    from mixprec.numerics.alignment import lint

    bs, seq = _shape_hints(batch[0]) if batch is not None else (None, None)
    report = lint(model, dtype, target=target, batch_size=bs, seq_len=seq)
    print(report)
    return report.as_dict()


def _fp8_plan_section(model: nn.Module, x: Any, fp8: FP8Config, doc: dict) -> FP8Config:
    """Print :func:`mixprec.fp8.fp8_plan`'s choices; returns the config the rest of the report
    runs (with ``layers="auto"``: the layers the plan chose)."""
    from mixprec.fp8 import fp8_plan

    plan = fp8_plan(model, x if isinstance(x, tuple) else (x,), config=fp8)
    print()
    print(plan)
    doc["fp8_plan"] = {n: _choice_dict(c) for n, c in plan.items()}
    if fp8.layers == "auto":  # the rest of the report runs the layers the plan chose
        fp8 = dataclasses.replace(fp8, layers=plan)
    return fp8


def _op_stats_section(
    observed: nn.Module,
    batch: Any,
    loss_fn: Callable,
    dtype: torch.dtype,
    fp8: FP8Config | None,
    doc: dict,
) -> None:
    from mixprec._core.engine import autocast
    from mixprec.numerics.opstats import op_stats
    from mixprec.recipe import Recipe

    x, y = batch
    with op_stats() as stats:
        with autocast(Recipe("O1", dtype, fp8=fp8)):
            loss = loss_fn(_forward(observed, x), y)
        loss.backward()
    name = doc["dtype"]
    what = f"{name}, fp8={fp8.recipe}" if fp8 is not None else name
    print(f"\nop statistics: one forward and backward under mixprec.autocast({what})")
    print(stats.table())
    doc["op_stats"] = {
        "forward": stats.as_dict("forward"),
        "backward": stats.as_dict("backward"),
        "totals": stats.totals(),
    }


def _range_section(model: nn.Module, batch: Any, loss_fn: Callable, saved: list, doc: dict) -> Any:
    """The fp32 range audit, then again at the recommended fp16 loss scale; the gradients in
    ``saved`` are put back after. Returns the unscaled audit (for the plots)."""
    from mixprec.numerics.range_audit import range_audit

    x, y = batch
    for p in model.parameters():
        p.grad = None
    with range_audit(model) as audit:  # fp32: the true values, judged for fp16 and bf16
        loss_fn(_forward(model, x), y).backward()
    scale = audit.recommended_loss_scale(torch.float16)
    for p in model.parameters():
        p.grad = None
    with range_audit(model, loss_scale=scale) as scaled:
        loss_fn(_forward(model, x), y).backward()
    for p, g in saved:
        p.grad = g
    print()
    print(audit.table("fp16"))
    grads1, grads_s = audit.merged("gradient"), scaled.merged("gradient")
    print(
        f"recommended fp16 loss scale: {scale:g} (gradient underflow in fp16: "
        f"{grads1.fractions('fp16')['underflow']:.2%} unscaled, "
        f"{grads_s.fractions('fp16')['underflow']:.2%} at {scale:g})"
    )
    doc["range_audit"] = audit.as_dict()
    doc["range_audit"]["at_recommended_scale"] = {"fp16": grads_s.fractions("fp16")}
    return audit


def _fp8_range_section(
    observed: nn.Module,
    batch: Any,
    loss_fn: Callable,
    dtype: torch.dtype,
    fp8: FP8Config,
    doc: dict,
) -> None:
    from mixprec._core.engine import autocast
    from mixprec.numerics.range_audit import range_audit
    from mixprec.recipe import Recipe

    x, y = batch
    with range_audit(observed) as fp8_audit, autocast(Recipe("O1", dtype, fp8=fp8)):
        loss = loss_fn(_forward(observed, x), y)
    loss.backward()
    print(f"\nFP8 layers ({fp8.recipe}): their casts, and their output against 16 bits")
    print(fp8_audit.fp8_table() if fp8_audit.fp8 else "no Linear runs in FP8.")
    doc["fp8"] = fp8_audit.as_dict()["fp8"]


def _locator_section(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable,
    dtype: torch.dtype,
    steps: int,
    fp8: FP8Config | None,
    doc: dict,
) -> None:
    """Train a copy for ``steps`` O2 steps under the locator."""
    from mixprec import Recipe, initialize
    from mixprec.numerics.locate import locate_nonfinite

    x, y = batch
    train = copy.deepcopy(model)
    opt = torch.optim.AdamW(train.parameters(), lr=1e-3)
    train, opt = initialize(train, opt, Recipe("O2", dtype, fp8=fp8))
    losses = []
    with locate_nonfinite(train, opt) as loc:
        for _ in range(steps):
            loss = loss_fn(_forward(train, x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    print(f"\nlocator over {steps} O2 step(s) (losses {', '.join(f'{v:.4g}' for v in losses)}):")
    print(loc.report())
    doc["locator"] = {
        "steps": steps,
        "losses": losses,
        "skipped_steps": opt.skipped_steps,
        "events": [e.as_dict() for e in loc.events],
    }


def _write_files(out: pathlib.Path, doc: dict, audit: Any) -> list[str]:
    """``OUT/report.json`` and, given the range audit, its PNG histograms; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    if audit is not None:
        for kind in ("gradient", "activation"):
            files.append(
                audit.plot(
                    str(out / f"range_{kind}.png"), kind, dtypes=(torch.float16, torch.bfloat16)
                )
            )
    path = out / "report.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    files.append(str(path))
    for f in files:
        print(f"wrote {f}")
    return files


def _choice_dict(c: Any) -> dict[str, Any]:
    out = {k: v for k, v in vars(c).items() if k not in ("input", "weight", "grad")}
    for k in ("input", "weight", "grad"):
        stats = getattr(c, k)
        out[k] = None if stats is None else vars(stats)
    return out


def _run(args: argparse.Namespace) -> int:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.model in (None, "tiny-gpt"):
        model, batch, loss_fn = builtin_model(args.seed)
        label = "built-in tiny GPT (2 layers, width 128, context 64, random tokens)"
    else:
        try:
            model, batch, loss_fn = load_factory(args.model)
        except (ValueError, TypeError) as e:
            print(f"mixprec report: {e}", file=sys.stderr)
            return 2
        label = args.model
    print(f"mixprec report: {label}, {args.dtype}, torch {torch.__version__}")
    run_report(
        model,
        batch,
        loss_fn,
        dtype=dtype,
        steps=args.steps,
        target=args.target,
        do_tune=args.tune,
        tolerance=args.tolerance,
        out=pathlib.Path(args.out),
        plots=not args.no_plots,
        fp8=None if args.fp8 is None else FP8Config(args.fp8, layers=args.fp8_layers),
    )
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to ``mixprec``'s subparsers."""
    r = sub.add_parser(
        "report",
        help="numerics report: lint, op stats, range audit, first inf/NaN, precision tuning",
    )
    r.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="'module:factory' returning model, (model, batch) or (model, batch, "
        "loss_fn); default: a built-in tiny GPT",
    )
    r.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    r.add_argument(
        "--steps", type=int, default=3, help="O2 training steps watched by the locator (default 3)"
    )
    r.add_argument(
        "--target",
        choices=["gpu", "tpu", "cpu"],
        default="gpu",
        help="hardware whose alignment rule the lint applies",
    )
    r.add_argument("--tune", action="store_true", help="also search the fp32 modules")
    r.add_argument("--tolerance", type=float, default=0.05)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="report_out", help="folder for report.json and PNGs")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument(
        "--fp8",
        nargs="?",
        const="tensorwise",
        default=None,
        choices=["tensorwise", "rowwise"],
        help="also plan, run and audit FP8 Linears (recipe; default tensorwise)",
    )
    r.add_argument(
        "--fp8-layers",
        choices=["auto", "all"],
        default="auto",
        help="which Linears --fp8 runs: the plan's choice (auto) or every eligible one",
    )
    r.set_defaults(run=_run)
    return r
