"""Hugging Face ``transformers.Trainer`` running mixprec levels: ``MixprecTrainer``.

Design: ``Trainer`` builds its optimizer in ``create_optimizer`` and routes every backward
through ``accelerator.backward``; those are the two seams used here. ``create_optimizer`` calls
:func:`mixprec.initialize` on the model and the optimizer Trainer built, and keeps the returned
:class:`mixprec._core.optimizer.MixedPrecisionOptimizer` (a ``torch.optim.Optimizer``, so Trainer's
LR scheduler
and accelerate accept it). The backward is wrapped in :func:`mixprec.scale_loss`; gradient
clipping and the logged grad norm use the unscaled fp32 masters. Leave ``fp16``/``bf16`` off in
``TrainingArguments``: mixprec does the mixed precision, and the two would stack.

With ``gradients="auto"`` (the "lean" recipe in bf16) the gradients are coded in 8 bits where
Trainer needs them all at once (held on several ranks) -- clipping (``max_grad_norm > 0``,
Trainer's default 1.0) or accumulation (``gradient_accumulation_steps > 1``) -- and the choice
is said in a warning (:mod:`mixprec.integrations._loop`); without either they are released,
and Trainer's logs leave ``grad_norm`` out (nothing is left to measure).

Limits: a skipped step (fp16 overflow) still advances Trainer's LR scheduler (accelerate's
skip flag comes from its own GradScaler); DeepSpeed/FSDP are not supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import Trainer

import mixprec
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec.integrations._loop import gradients_for_loop
from mixprec.recipe import Recipe, as_recipe

__all__ = ["MixprecTrainer"]


class MixprecTrainer(Trainer):
    """``transformers.Trainer`` with mixprec: ``MixprecTrainer(..., mixprec_recipe="O2")``.

    Args:
        mixprec_recipe: a :class:`mixprec.Recipe` or name (see :func:`mixprec.initialize`).
        mixprec_dtype: the 16-bit dtype; None: the recipe's, else the best one for the device.
        *args, **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        mixprec_recipe: Recipe | str = "O1",
        mixprec_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        for old in ("mixprec_level", "mixprec_options"):
            if old in kwargs:
                raise TypeError(
                    f"MixprecTrainer takes mixprec_recipe (a mixprec.Recipe or a name such as "
                    f"'O2'), not {old}=: e.g. mixprec_recipe=mixprec.Recipe('O2', "
                    "torch.bfloat16, loss_scale=128.0)."
                )
        # a bad name fails here, not at the first step
        recipe = as_recipe(mixprec_recipe, mixprec_dtype)
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.args.bf16:
            raise ValueError(
                f"MixprecTrainer does the mixed precision itself; received "
                f"TrainingArguments(fp16={self.args.fp16}, bf16={self.args.bf16}). "
                "Set both to False and choose mixprec_recipe/mixprec_dtype instead."
            )
        self.mixprec_recipe = recipe
        self.mixprec_optimizer: MixedPrecisionOptimizer | None = None
        backward = self.accelerator.backward

        def scaled_backward(loss: torch.Tensor, **kw: Any) -> None:
            if self.mixprec_optimizer is None:
                return backward(loss, **kw)
            with mixprec.scale_loss(loss, self.mixprec_optimizer) as scaled:
                backward(scaled, **kw)

        self.accelerator.backward = scaled_backward

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = (
            super().create_optimizer(model) if model is not None else super().create_optimizer()
        )
        if self.mixprec_optimizer is None:
            target = self.model if model is None else model
            needs = []
            if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                needs.append(f"clips (max_grad_norm={self.args.max_grad_norm})")
            if self.args.gradient_accumulation_steps > 1:
                steps = self.args.gradient_accumulation_steps
                needs.append(f"accumulates (gradient_accumulation_steps={steps})")
            recipe = gradients_for_loop(
                self.mixprec_recipe, needs, "MixprecTrainer", self.args.device
            )
            _, wrapped = mixprec.initialize(target, optimizer, recipe)
            self.optimizer = self.mixprec_optimizer = wrapped
        return self.optimizer

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.mixprec_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        if grad_norm is None:
            updater = self.mixprec_optimizer.updater
            if updater is not None and updater.asked != "held":  # released (or "auto"
                return None  # deciding): nothing to measure; Trainer leaves grad_norm out
            grad_norm = self.mixprec_optimizer.clip_grad_norm_(math.inf)
        return float(grad_norm)
