"""Checkpoint plumbing of the Apex shim: fp32 model state dicts, and Apex's restore order.

Design (``docs/design.md``, "Compatibility layers"):

* At O2/O3 (and ``cast_model_type=False``) every submodule gets a state-dict hook pair:
  ``model.state_dict()`` returns float32, taking the fp32 masters' exact values where they
  exist (Apex returns fp32 casts of the 16-bit weights, so a resume loses the masters'
  precision), and ``load_state_dict`` writes the loaded values into the masters too.
* Apex's documented restore order (load a checkpoint into a fresh fp32 model and plain torch
  optimizer *before* ``amp.initialize``) is :func:`mixprec.initialize`'s own: the masters start
  from the fp32 values, and the loaded optimizer state moves onto them by index.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from mixprec._core.optimizer import MixedPrecisionOptimizer

__all__ = ["install_fp32_state_dict"]


def _master_map(wrappers: list[MixedPrecisionOptimizer]) -> dict[int, Tensor]:
    return {
        id(p): m
        for w in wrappers
        for p, m in zip(w.model_params(), w.master_params())
        if p is not m
    }


def install_fp32_state_dict(model: nn.Module, wrappers: list[MixedPrecisionOptimizer]) -> None:
    """``state_dict()`` returns fp32 (exact master values); loading also sets the masters."""
    refs = [weakref.ref(w) for w in wrappers]

    def live() -> list[MixedPrecisionOptimizer]:
        return [w for w in (r() for r in refs) if w is not None]

    def save_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        masters = _master_map(live())
        own = dict(module.named_parameters(recurse=False))
        own.update(dict(module.named_buffers(recurse=False)))
        for name, t in own.items():
            key = prefix + name
            if t is None or key not in state_dict or not t.is_floating_point():
                continue
            src = masters.get(id(t))
            if src is not None:
                state_dict[key] = src.detach().clone()
            elif t.dtype in (torch.float16, torch.bfloat16):
                state_dict[key] = state_dict[key].float()

    @torch.no_grad()
    def load_hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        masters = _master_map(live())
        for name, p in module.named_parameters(recurse=False):
            value, master = state_dict.get(prefix + name), masters.get(id(p))
            if master is not None and isinstance(value, Tensor) and value.shape == master.shape:
                master.copy_(value)

    for module in model.modules():
        module._register_state_dict_hook(save_hook)
        module.register_load_state_dict_pre_hook(load_hook)
