"""Apex's ``fp16_utils``: ``FP16_Optimizer`` and the model-conversion helpers, on mixprec.

Design (``docs/design.md``, "Compatibility layers"): ``FP16_Optimizer`` is a thin shell around
:class:`mixprec._core.optimizer.MixedPrecisionOptimizer` with fp32 masters
(``UpdatePlan(masters=True)``) and one loss scaler, so it gets mixprec's fused unscale +
finite check, bitwise-unchanged skipped steps and exact checkpoints. Apex's signature,
defaults and method names are kept. Differences (none breaks a caller):

* The overflow verdict is read once per step, in ``step()`` (Apex syncs in every ``backward``).
  ``overflow`` is the last step's verdict; ``clip_master_grads`` returns -1 on a non-finite norm
  as Apex does.
* ``state_dict()`` holds plain values (the scaler's state as a dict, not a pickled object), so
  it loads with ``torch.load(weights_only=True)``; the masters are saved, as in Apex.
* ``dynamic_loss_args["scale_factor"]`` is honoured (Apex accepts and ignores it).
* ``step(closure)`` evaluates the closure once, then steps; LBFGS-style optimizers that call the
  closure themselves are not supported (Apex documents them as incompatible with dynamic
  scaling too).
* Apex's ``bfloat16`` blind spot: bf16 parameters get fp32 masters exactly like fp16 ones.
* The masters start from the fp32 values ``network_to_half`` / ``convert_network`` / ``FP16Model``
  cast, not from their 16-bit rounding (Apex copies the rounded weights): the conversion keeps
  each trainable parameter's fp32 tensor until an ``FP16_Optimizer`` takes it as a master or
  the network first runs forward, whichever comes first (no copy is made; the fp32 storage is
  released later than it would be). After ``model.half()`` only the rounded values exist.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from mixprec._core._gradients import LossSlot
from mixprec._core.loss_scale import LossScaler
from mixprec._core.optimizer import MixedPrecisionOptimizer, rounds_to
from mixprec._core.resume import pack_state_dict
from mixprec._core.update.choice import UpdatePlan

__all__ = ["FP16Model", "FP16_Optimizer", "convert_network", "network_to_half", "to_python_float"]

_DYNAMIC_ARGS = {
    "init_scale": "init_scale",
    "scale_window": "growth_interval",
    "min_loss_scale": "min_scale",
    "max_loss_scale": "max_scale",
    "scale_factor": "growth_factor",
}


def _scaler(static_loss_scale: float, dynamic: bool, args: dict[str, Any] | None) -> LossScaler:
    if not dynamic:
        if args:
            raise ValueError("dynamic_loss_args only apply with dynamic_loss_scale=True.")
        return LossScaler(float(static_loss_scale), dynamic=False)
    unknown = sorted(set(args or {}) - set(_DYNAMIC_ARGS))
    if unknown:
        raise ValueError(f"Unknown dynamic_loss_args {unknown}; allowed: {sorted(_DYNAMIC_ARGS)}.")
    opts = {_DYNAMIC_ARGS[k]: v for k, v in (args or {}).items() if v is not None}
    opts.setdefault("max_scale", 2.0**24)
    opts.setdefault("init_scale", min(2.0**16, opts["max_scale"]))  # Apex amp LossScaler
    opts.setdefault("growth_interval", 2000)
    if "growth_factor" in opts:
        opts["growth_factor"] = float(opts["growth_factor"])
        opts.setdefault("backoff_factor", 1.0 / opts["growth_factor"])
    return LossScaler(**opts)


class FP16_Optimizer:
    """Apex's ``FP16_Optimizer(init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
    dynamic_loss_args=None, verbose=True)``: fp32 master weights for a 16-bit model.

    Example::

        model = network_to_half(model)                 # or model.half()
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   dynamic_loss_scale=True)
        loss = loss_fn(model(x).float(), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.clip_master_grads(1.0)
        optimizer.step()
    """

    def __init__(
        self,
        init_optimizer: Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        verbose: bool = True,
    ) -> None:
        if not isinstance(init_optimizer, Optimizer) or isinstance(
            init_optimizer, MixedPrecisionOptimizer
        ):
            raise TypeError(
                f"FP16_Optimizer wraps a plain torch.optim.Optimizer; received "
                f"{type(init_optimizer).__name__}."
            )
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        scaler = _scaler(static_loss_scale, self.dynamic_loss_scale, dynamic_loss_args)
        self._slot = LossSlot(scaler)
        self.mixed = MixedPrecisionOptimizer(
            init_optimizer,
            [self._slot],
            UpdatePlan(masters=True),
            fp32_values=_take_fp32(init_optimizer),
        )
        self.optimizer = init_optimizer
        self.first_closure_call_this_step = True
        self.verbose = verbose
        if verbose:
            n = sum(
                p is not m for p, m in zip(self.mixed.model_params(), self.mixed.master_params())
            )
            print(
                f"FP16_Optimizer (mixprec): {n} 16-bit parameter(s) got fp32 masters; "
                f"loss scale {'dynamic' if self.dynamic_loss_scale else scaler.scale}. "
                "New code: mixprec.initialize(model, optimizer, 'O2')."
            )

    # -- Apex's promoted properties --------------------------------------------------------
    param_groups = property(
        lambda self: self.optimizer.param_groups,
        lambda self, v: setattr(self.optimizer, "param_groups", v),
    )
    state = property(lambda self: self.optimizer.state)

    @property
    def loss_scaler(self) -> LossScaler:
        return self._slot.scaler

    @property
    def loss_scale(self) -> float:
        return self._slot.scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        full = self._slot.scaler.state_dict()
        full["scale"] = float(value)
        self._slot.scaler.load_state_dict(full)

    @property
    def overflow(self) -> bool:
        """True if the last ``step()`` was skipped for a non-finite gradient."""
        return self.mixed.step_skipped

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r}, loss_scale={self.loss_scale})"

    # -- the training loop -----------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        self.mixed.zero_grad(set_to_none=set_grads_to_None)

    def backward(
        self, loss: Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """``(loss.float() * loss_scale).backward()``, then unscale into the fp32 masters.

        ``update_master_grads=False`` is accepted: mixprec always unscales each backward with its
        own scale, so several backwards accumulate correctly either way.
        """
        self.mixed.backward(loss.float(), retain_graph=retain_graph)

    def update_master_grads(self) -> None:
        """Kept for Apex code: the masters are already up to date after every ``backward``."""

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the fp32 master gradients; return their total norm, or -1 if non-finite."""
        norm = float(self.mixed.clip_grad_norm_(max_norm, norm_type))
        return norm if torch.isfinite(torch.tensor(norm)) else -1

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters and copy them to the model, or skip on a non-finite gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.mixed.step()
        if self.mixed.step_skipped and self.verbose:
            print(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scale}")
        return loss

    def inspect_master_grad_data(self) -> list[list[Tensor | None]] | None:
        if self.overflow:
            return None
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        masters = self.mixed.mixprec_state_dict()["masters"]
        return {
            "loss_scaler": self._slot.scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": masters,
            "skipped_steps": self.mixed.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scaler, optimizer state and the saved fp32 masters (not re-derived)."""
        scaler = state_dict["loss_scaler"]
        if not isinstance(scaler, dict):  # an Apex pickle: take what the object carries
            scale = getattr(scaler, "cur_scale", getattr(scaler, "_loss_scale", None))
            scaler = dict(self._slot.scaler.state_dict(), scale=float(scale))
        masters = state_dict["fp32_from_fp16"]
        if masters and isinstance(masters[0], (list, tuple)):  # Apex: one list per group
            masters = [m for group in masters for m in group]
        own = {
            "masters": list(masters),
            "scalers": [scaler],
            "skipped_steps": int(state_dict.get("skipped_steps", 0)),
            "step_skipped": bool(state_dict.get("overflow", False)),
        }
        self.mixed.load_state_dict(pack_state_dict(state_dict["optimizer_state_dict"], own))
        self.dynamic_loss_scale = bool(
            state_dict.get("dynamic_loss_scale", self.dynamic_loss_scale)
        )
        self.first_closure_call_this_step = bool(
            state_dict.get("first_closure_call_this_step", True)
        )


# -- model conversion helpers (apex/fp16_utils/fp16util.py) ----------------------------------


# id(parameter) -> (weak ref to it, the fp32 tensor it held before convert_network cast it)
_fp32_before: dict[int, tuple[weakref.ref, Tensor]] = {}


def _take_fp32(optimizer: Optimizer) -> dict[int, Tensor]:
    """The pre-cast fp32 values of ``optimizer``'s parameters that still hold their rounding."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            hit = _fp32_before.pop(id(p), None)
            if hit is not None and hit[0]() is p and rounds_to(hit[1], p):
                out[id(p)] = hit[1]
    return out


def _forget_fp32(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: the network runs without an FP16_Optimizer taking its fp32 values."""
    for p in module.parameters():
        _fp32_before.pop(id(p), None)
    handle = module.__dict__.pop("_mixprec_forget_fp32", None)
    if handle is not None:
        handle.remove()


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters and buffers of every module except affine batchnorm (Apex's rule)."""
    for key in [k for k, (ref, _) in _fp32_before.items() if ref() is None]:
        del _fp32_before[key]  # parameters that are gone
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                if p.requires_grad and p.dtype == torch.float32 and dtype != torch.float32:
                    _fp32_before[id(p)] = (weakref.ref(p), p.data)
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
    if "_mixprec_forget_fp32" not in network.__dict__:
        network.__dict__["_mixprec_forget_fp32"] = network.register_forward_pre_hook(_forget_fp32)
    return network


class _ToDtype(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x


def network_to_half(network: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """``Sequential(cast input, network in 16-bit with affine batchnorm fp32)``, as in Apex."""
    return nn.Sequential(_ToDtype(dtype), convert_network(network, dtype))


class FP16Model(nn.Module):
    """Apex's ``FP16Model(network)``: converts the network and casts every input to 16-bit."""

    def __init__(self, network: nn.Module, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.network = convert_network(network, dtype)
        self.dtype = dtype

    def forward(self, *inputs: Any) -> Any:
        return self.network(
            *(
                x.to(self.dtype) if isinstance(x, Tensor) and x.is_floating_point() else x
                for x in inputs
            )
        )


def to_python_float(t: Any) -> float:
    return float(t.item() if isinstance(t, Tensor) else t)
