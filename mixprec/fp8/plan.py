"""``mixprec.fp8.fp8_plan``: each Linear's FP8 choice and its reason, ahead of training.

Design: the plan runs the model once on a real batch with a forward pre-hook on every plain
``nn.Linear`` (and, given ``loss_fn``, a hook on its output gradient) and hands each layer's
input, weight and gradient to the same :func:`~mixprec.fp8.choice.decide` that an
``"auto"`` layer calls on its first batch, so the plan and training choose alike. The speed
side takes ``tokens`` (M) from the batch unless given: measure on a small batch, judge at the
training batch's size. Nothing is changed in the model; its parameters' gradients are put
back as they were.

Without a batch, the plan of a model already prepared by ``initialize(fp8=...)`` lists the
choices its layers made (pending ones marked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.fp8.choice import FP8Choice, FP8Plan, decide
from mixprec.fp8.config import FP8Config, as_fp8_config
from mixprec.fp8.gemm import layer_shape_ok
from mixprec.fp8.layers import candidates, default_target, layers_of

__all__ = ["fp8_plan"]


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    raise TypeError(
        f"fp8_plan's batch is the model's input: a tensor, a tuple of positional arguments or "
        f"a dict of keyword arguments; received {type(batch).__name__}."
    )


def fp8_plan(
    model: nn.Module,
    batch: Any = None,
    *,
    config: FP8Config | str | bool | None = None,
    tokens: int | None = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
) -> FP8Plan:
    """Which Linear layers run in FP8, and why: the choice of ``layers="auto"``.

    Args:
        model: the model (plain, or already given ``fp8=`` by :func:`mixprec.initialize`).
        batch: the model's input on a real batch (a tensor, a tuple of positional arguments or
            a dict of keyword arguments). None: report the choices the model's FP8 layers made.
        config: the recipe and target GPU (``True``, a recipe name or an :class:`FP8Config`;
            default tensorwise, the device's GPU or an H100). Its ``layers`` is not used: the
            plan is what ``"auto"`` would choose.
        tokens: M, the tokens per GEMM the speed side is judged at (default: the batch's).
        loss_fn: ``loss_fn(output) -> loss``; given, a backward pass also measures each
            layer's output gradient in the recipe's gradient format.

    Returns:
        An :class:`FP8Plan` (a ``path -> FP8Choice`` mapping; print it for a table). Pass it
        as ``FP8Config(layers=plan)`` to train with exactly these layers.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
        >>> plan = fp8_plan(model, torch.randn(16, 32))
        >>> plan.chosen  # too small to gain on an H100
        []
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_plan expects an nn.Module, received {type(model).__name__}.")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        raise ValueError(f"tokens must be a positive int (M of the GEMMs), received {tokens!r}.")
    cfg = as_fp8_config(True if config is None else config)
    if cfg is None:
        raise ValueError(
            "fp8_plan needs a recipe: config=True, 'tensorwise', 'rowwise' or FP8Config."
        )
    if batch is None:
        return _plan_of_prepared(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    target = default_target(device, cfg)
    linears, left_out = candidates(getattr(model, "_orig_mod", model))
    watched = [
        (name, m)
        for name, m in linears
        if name not in left_out and not layer_shape_ok(m.in_features, m.out_features)
    ]
    seen, grads = _observe(model, batch, watched, loss_fn)
    choices: dict[str, FP8Choice] = {}
    for name, m in linears:
        if name in left_out:
            choices[name] = FP8Choice(name, False, left_out[name], target=target)
            continue
        bad = layer_shape_ok(m.in_features, m.out_features)
        if bad is not None:
            choices[name] = FP8Choice(name, False, bad, target=target)
        elif name not in seen:
            choices[name] = FP8Choice(name, False, "not called on this batch", target=target)
        else:
            w, grad = m.weight.detach(), grads.get(name)
            choices[name] = decide(name, cfg.scaling, seen[name], w, target, tokens, grad)
    return FP8Plan(choices, cfg.recipe, target)


def _plan_of_prepared(model: nn.Module) -> FP8Plan:
    """The choices (pending ones marked) of a model given ``fp8=`` by ``initialize``."""
    layers = layers_of(model)
    if not layers:
        raise ValueError(
            "fp8_plan(model) without a batch lists the choices of a model given fp8= by "
            "mixprec.initialize; this one has none. Pass a batch: fp8_plan(model, batch)."
        )
    first = next(iter(layers.values()))
    return FP8Plan(
        {n: layer.current() for n, layer in layers.items()}, first.recipe.name, first.target
    )


def _observe(
    model: nn.Module,
    batch: Any,
    linears: list[tuple[str, nn.Linear]],
    loss_fn: Callable[[Any], Tensor] | None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Run ``model`` on ``batch`` (and backward through ``loss_fn``, if given) and return each
    of ``linears``' first input and output gradient, by name. The parameters' gradients are
    put back as they were."""
    seen: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    handles = []

    def watch(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: nn.Module, args: tuple) -> None:
            if name not in seen and args and isinstance(args[0], Tensor):
                seen[name] = args[0].detach()

        def post(module: nn.Module, args: tuple, out: Any) -> None:
            if loss_fn is not None and isinstance(out, Tensor) and out.requires_grad:
                out.register_hook(lambda g: grads.setdefault(name, g.detach()))

        return pre, post

    for name, m in linears:
        pre, post = watch(name)
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    before = {p: p.grad for p in model.parameters()}
    if loss_fn is not None:
        for p in before:  # backward accumulates into an existing .grad in place
            p.grad = None
    try:
        with torch.set_grad_enabled(loss_fn is not None):
            out = _call(model, batch)
            if loss_fn is not None:
                loss = loss_fn(out)
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in before.items():
            p.grad = g
    return seen, grads
