"""The model's float32 values across loads and saves: masters follow ``load_state_dict``, and
:func:`fp32_state_dict` saves the model in fp32 whatever it trained in.

Design: the fp32 truth of a 16-bit weight lives beside it -- an fp32 master, a Kahan
compensation (``w + c``) or a frozen fp32 copy. A load into the 16-bit model refreshes that
truth (or keeps it, where the load is its own 16-bit rounding: a resume), and a save reads it,
so a checkpoint round-trips bit for bit in either direction.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mixprec._core.optimizer import MixedPrecisionOptimizer, rounds_to
from mixprec._core.recipe_change import carried_value
from mixprec._core.resume import kahan_fp32, merge_compensation
from mixprec._core.storage import FROZEN_ATTR

__all__ = ["LoadRefresh", "fp32_state_dict", "install_load_refresh"]


class LoadRefresh:
    """Keeps fp32 masters (and Kahan compensation) in step with ``model.load_state_dict``.

    Loading weights after initialize (build, initialize, load pretrained) writes the model's
    16-bit parameters; without this the next step would copy the stale masters back over them.
    The masters take the *loaded* values (an fp32 checkpoint, e.g. from :func:`fp32_state_dict`,
    round-trips exactly), and a loaded parameter's compensation is reset. Parameters are matched
    by identity, so a deep copy of the model (new parameters) never touches these optimizers.
    """

    def __init__(self, optimizers: list[MixedPrecisionOptimizer], models: list[nn.Module]) -> None:
        self.frozen: dict[int, tuple[weakref.ref, Tensor]] = {}  # frozen_masters copies:
        for model in models:  # masters without an optimizer
            for m in model.modules():
                for name, fp32 in m.__dict__.get(FROZEN_ATTR, {}).items():
                    p = m._parameters[name]
                    self.frozen[id(p)] = (weakref.ref(p), fp32)
        self.pending: list[tuple[Tensor, Any, Tensor, bool]] = []
        self.optimizers = [weakref.ref(o) for o in optimizers]

    def __getstate__(self) -> dict[str, Any]:
        # weakrefs do not pickle, and a pickled model is a copy with other parameters: its
        # hooks refresh nothing (torch.save(model) must keep working after initialize)
        return {"frozen": {}, "pending": [], "optimizers": []}

    def _targets(self, p: Tensor) -> list[Any]:
        """What a load into ``p`` refreshes: its fp32 master, or the updater stepping it (its
        Kahan compensation; a checkpoint of another recipe it carries)."""
        hit = self.frozen.get(id(p))
        out = [hit[1]] if hit is not None and hit[0]() is p else []
        for o in (ref() for ref in self.optimizers):
            master = None if o is None else o._model_to_master.get(p)
            if master is not None:
                out.append(master)
            elif o is not None and o.updater is not None and id(p) in o.updater._ordinal:
                out.append(o.updater)
        return out

    def before(
        self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any
    ) -> None:
        for name, p in module._parameters.items():
            src = state_dict.get(prefix + name)
            if p is None or not isinstance(src, Tensor):
                continue
            for target in self._targets(p):
                same = src.dtype == p.dtype and torch.equal(src, p.detach())
                self.pending.append((p, target, src, same))

    @torch.no_grad()
    def after(self, module: nn.Module, incompatible: Any) -> None:
        pending, self.pending = self.pending, []
        for p, target, src, same in pending:
            if isinstance(target, Tensor):
                if src.shape != target.shape or rounds_to(target, src):
                    continue  # a 16-bit copy of this very master (a resume): keep its precision
                target.copy_(src)
                continue
            comp = target.compensation.get(p)  # a ModeUpdater's Kahan buffer
            if comp is not None and not same and src.dtype.itemsize > p.dtype.itemsize:
                # a wider load (pretrained fp32): the residual of rounding it, except where
                # w + c already is the loaded value (fp32_state_dict of the state restored
                # before). A 16-bit load keeps the buffer: it is a resume, whose optimizer
                # state restored it.
                comp.copy_(merge_compensation(src.to(p.device), p, comp))
        for p, _, src, _ in pending:
            self._complete(p, src)

    def _complete(self, p: Tensor, src: Tensor) -> None:
        """A checkpoint of another recipe loaded into the optimizer before this load: where
        its rule adds a saved compensation to the 16-bit weight (``w + c`` into a master, or
        folded into the weight), the weight is only known now."""
        for ref in self.optimizers:
            o = ref()
            value = None if o is None else carried_value(o, p, src)
            if value is None:
                continue
            master = o._model_to_master.get(p)
            if master is not None:
                master.copy_(value)
            p.copy_(value)


def install_load_refresh(
    optimizers: list[MixedPrecisionOptimizer], models: list[nn.Module]
) -> None:
    """Hook every module that holds parameters (a submodule may be loaded on its own)."""
    refresh = LoadRefresh(optimizers, models)
    for model in models:
        for m in model.modules():
            if m._parameters:
                m.register_load_state_dict_pre_hook(refresh.before)
                m.register_load_state_dict_post_hook(refresh.after)


@torch.no_grad()
def fp32_state_dict(
    model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
) -> dict[str, Tensor]:
    """The model's state dict in float32 under its own keys, from the masters where they exist.

    It loads into a plain fp32 copy of the model (``load_state_dict``): the model is saved in
    fp32 whatever it trained in. With ``update="kahan"`` a weight's fp32 value is ``w + c`` (the
    16-bit weight plus its compensation buffer), moved one fp32 ulp toward ``w`` where ``w + c``
    lies exactly half-way between two 16-bit values (:func:`mixprec._core.resume.kahan_fp32`), so
    that loading it gives back ``w``; with the optimizer's state dict (loaded before or after
    ``initialize``) ``c`` comes back too, and a resume is bit for bit.
    """
    masters = {} if optimizer is None else {id(p): m for p, m in optimizer._pairs}
    updater = None if optimizer is None else getattr(optimizer, "updater", None)
    if updater is not None:
        masters.update({id(p): kahan_fp32(p, c) for p, c in updater.compensation.items()})
    for m in model.modules():
        for name, fp32 in m.__dict__.get(FROZEN_ATTR, {}).items():
            p = m._parameters.get(name)
            if p is not None:
                masters.setdefault(id(p), fp32)
    by_id = {id(p): p for p in model.parameters()}
    out: dict[str, Tensor] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for key, value in model.state_dict(keep_vars=True).items():
        source = named.get(key, value)
        source = masters.get(id(by_id.get(id(source), source)), source)
        t = source.detach()
        out[key] = (
            t.to(torch.float32).clone()
            if t.is_floating_point() and t.dtype != torch.float64
            else t.clone()
        )
    return out
