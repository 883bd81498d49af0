"""A PyTorch Lightning precision plugin that runs mixprec levels: ``MixprecPrecision("O2")``.

Design (``docs/design.md``, "Compatibility layers"): Lightning's ``MixedPrecision`` plugin is
torch.autocast + GradScaler. This plugin swaps in mixprec at the four seams Lightning offers:

* ``connect`` -- calls :func:`mixprec.initialize` on the LightningModule and its optimizers
  (casting at O2/O3, fp32 masters) and hands Lightning the returned optimizers, which are
  ``torch.optim.Optimizer`` subclasses, so LR schedulers and ``LightningOptimizer`` keep working;
* ``forward_context`` -- a :class:`mixprec.autocast` region around every ``*_step``, because
  ``training_step`` often calls submodules directly, past the root module's boundary;
* ``backward`` -- :func:`mixprec.scale_loss` around ``model.backward`` (user overrides still run);
* ``optimizer_step`` -- run the closure, then the mixprec step (skipped on inf/NaN). Clipping
  needs nothing: Lightning clips ``optimizer.param_groups``, the already-unscaled fp32 masters.

With ``gradients="auto"`` (the "lean" recipe in bf16), ``connect`` codes the gradients in 8
bits where the Trainer needs them all at once -- ``gradient_clip_val`` or
``accumulate_grad_batches > 1`` -- holds them where it clips by value, and says so in a warning
(:mod:`mixprec.integrations._loop`); without either they are released.

Works with ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``, whichever is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import Tensor

import mixprec
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec.integrations._loop import gradients_for_loop
from mixprec.recipe import Recipe, as_recipe

try:  # the unified package first, then the standalone one
    from lightning.pytorch.plugins.precision import Precision as _Precision
except ImportError:  # pragma: no cover - depends on the environment
    from pytorch_lightning.plugins.precision import Precision as _Precision

__all__ = ["MixprecPrecision"]

_NAMES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


class MixprecPrecision(_Precision):
    """Lightning precision plugin: ``Trainer(plugins=[MixprecPrecision("O2", torch.bfloat16)])``.

    Args:
        recipe: a :class:`mixprec.Recipe` or name (see :func:`mixprec.initialize`); default O1,
            Lightning's ``"bf16-mixed"`` / ``"16-mixed"``.
        dtype: the 16-bit dtype; None: the recipe's, else the best one for the device.
    """

    def __init__(self, recipe: Recipe | str = "O1", dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.recipe = as_recipe(recipe, dtype)
        self.level = level = self.recipe.level
        self.dtype = self.recipe.dtype
        self.optimizers: list[MixedPrecisionOptimizer] = []
        self._pending_state: dict[str, Any] | None = None
        self.precision = "32-true" if level == "O0" else _NAMES.get(self.dtype, "bf16-mixed")

    # -- setup -------------------------------------------------------------------------------
    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        recipe = self.recipe
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and optimizers:
            needs = []
            if trainer.gradient_clip_val:
                needs.append(f"clips (gradient_clip_val={trainer.gradient_clip_val})")
            if trainer.accumulate_grad_batches > 1:
                batches = trainer.accumulate_grad_batches
                needs.append(f"accumulates (accumulate_grad_batches={batches})")
            device = next((p.device for p in model.parameters()), None)
            by_value = trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value"
            recipe = gradients_for_loop(recipe, needs, "MixprecPrecision", device, by_value)
        if optimizers:
            model, wrapped = mixprec.initialize(model, list(optimizers), recipe)
        else:
            model, wrapped = mixprec.initialize(model, None, recipe), []
        self.optimizers = list(wrapped)
        params = [p for p in model.parameters() if p.is_floating_point()]
        self.dtype = (
            next((p.dtype for p in params if p.dtype != torch.float32), None)
            or self.dtype
            or mixprec.default_dtype(params[0].device if params else None)
        )
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        return model, self.optimizers, lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.level == "O0":
            yield
            return
        with mixprec.autocast(self.dtype):
            yield

    # -- backward and step -------------------------------------------------------------------
    def backward(
        self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if not self.optimizers:
            model.backward(tensor, *args, **kwargs)
            return
        with mixprec.scale_loss(tensor, self.optimizers) as scaled:
            model.backward(scaled, *args, **kwargs)

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        closure_result = self._wrap_closure(model, optimizer, closure)
        skipped_backward = closure_result is None
        if getattr(model, "automatic_optimization", True) and skipped_backward:
            return closure_result  # training_step returned None: nothing to step
        optimizer.step(**kwargs)
        return closure_result

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Loss scalers and fp32 masters: Lightning saves the 16-bit model at O2, and the
        masters would otherwise be rebuilt from it with fp16/bf16 precision."""
        return {
            "optimizers": [
                {
                    "masters": o.mixprec_state_dict()["masters"],
                    "scalers": [s.scaler.state_dict() for s in o.slots],
                }
                for o in self.optimizers
            ]
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.optimizers:
            self._pending_state = state_dict  # applied in connect
            return
        self._pending_state = None
        for opt, saved in zip(self.optimizers, state_dict.get("optimizers", [])):
            for (p, m), value in zip(opt._pairs, saved["masters"]):
                m.copy_(value)
                p.copy_(value)
            for slot, sd in zip(opt.slots, saved["scalers"]):
                slot.scaler.load_state_dict(sd)
