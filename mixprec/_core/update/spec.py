"""One kind of one-pass step, stated once, and the one choice of what runs it.

A parameter's step is a :class:`StepKind` -- the optimizer and the flags that change its code,
the update mode, the weight's and gradient's dtypes, how each state is held (:class:`Held`) --
and every backend derives from it: the C loop's defines, the compiled function
(:mod:`.compiled_step`), the scalars (named once in :data:`SCALARS`); hashable, it is the
compile key. :func:`choose` says which backend steps a parameter, and why: ``"c"`` (the C loop,
on a CPU), ``"compiled"`` (:func:`torch.compile`: Triton on a GPU) or ``"chunk"`` (the
reference, :mod:`.modes`, for what no backend supports). ``docs/design.md``, "Lean 16-bit updates".
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW

from mixprec._core.update.state_codes import (
    _E4M3_MAX,
    QuantizedState,
    _largest,
    _layout,
    kind_of,
    quantizable,
)

__all__ = ["CPU_BACKEND", "MIN_NUMEL", "SCALARS", "Choice", "Held", "StepKind", "choose"]

#: what steps a parameter on a CPU where one pass can: ``"c"`` (the default), ``"compiled"``
#: (inductor's C++: the GPU's compiled loop, tested on a CPU) or ``"chunk"`` (the reference)
CPU_BACKEND = "c"
#: the compiled loop takes parameters of at least this many elements (a smaller one is not
#: worth a graph; the C loop has no compile per size and takes every size)
MIN_NUMEL = 2**16

#: the host scalars of each optimizer's step, in the order the backends read them
SCALARS = {
    "adam": ("decay", "coupled_wd", "sign", "one_minus_beta1", "beta2", "one_minus_beta2",
             "neg_step_size", "sqrt_bc2", "eps"),
    "sgd": ("sign", "wd", "momentum", "one_minus_dampening", "neg_lr"),
}  # fmt: skip
_LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_LOW)
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_UPDATE = {"nearest": 0, "kahan": 1, "stochastic": 2}
#: each optimizer's states, in the order the backends take them
_NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def index(optimizer: str) -> dict[str, int]:
    """Each scalar's position in the scalar vector of ``optimizer``'s step."""
    return {name: i for i, name in enumerate(SCALARS[optimizer])}


class Held(NamedTuple):
    """How one state is held: a ``dtype``, or codes of ``fmt`` and ``kind``
    (:mod:`.state_codes`); ``from_fp32``: codes wanted, fp32 values held (a checkpoint that
    saved the state decoded): read as fp32 this once and written as codes."""

    dtype: torch.dtype | None = None
    fmt: str | None = None
    kind: str | None = None
    from_fp32: bool = False

    @property
    def largest(self) -> float:
        """The largest code's value (1.0 for a tensor): a block's scale divides by it."""
        if self.fmt is None:
            return 1.0
        if (self.fmt, self.kind) == ("8-bit", "signed"):
            return _E4M3_MAX
        return _largest(*_layout(self.fmt, self.kind)[1:])

    def defines(self, name: str) -> list[str]:
        """The C loop's -D flags of this state as ``name`` (S1, S2)."""
        if self.fmt is None:
            return [f"-D{name}={_CODE[self.dtype]}"]
        bits, mag, m, emin = _layout(self.fmt, self.kind)
        e4m3 = int((self.fmt, self.kind) == ("8-bit", "signed"))
        return [f"-D{name}={bits}", f"-D{name}K={int(self.kind == 'sqrt')}",
                f"-D{name}MAG={mag}", f"-D{name}MB={m}", f"-D{name}EMIN={emin}",
                f"-D{name}E4M3={e4m3}", f"-D{name}LARGEST={self.largest!r}f",
                f"-D{name}SRC={int(self.from_fp32)}"]  # fmt: skip


class StepKind(NamedTuple):
    """One kind of one-pass step (see the module docstring)."""

    optimizer: str  # "adam" or "sgd"
    update: str  # "nearest", "kahan" or "stochastic"
    weight: torch.dtype
    grad: torch.dtype
    states: tuple[Held, ...]
    decoupled: bool = False  # adam: AdamW's weight decay
    momentum: bool = False  # sgd
    nesterov: bool = False  # sgd

    @property
    def names(self) -> tuple[str, ...]:
        """The optimizer's state names, in the order of :attr:`states`."""
        return _NAMES[self.optimizer][: len(self.states)]

    @property
    def coded(self) -> bool:
        return any(h.fmt is not None for h in self.states)

    def defines(self) -> list[str]:
        """The C loop's -D flags: the step's shape, each state, each scalar's position."""
        flags = {"ADAM": self.optimizer == "adam", "DECOUPLED": self.decoupled,
                 "MOMENTUM": self.momentum, "NESTEROV": self.nesterov}  # fmt: skip
        out = [f"-D{k}" for k, on in flags.items() if on]
        out += [f"-DUPDATE={_UPDATE[self.update]}", f"-DW16={_CODE[self.weight]}",
                f"-DG={_CODE[self.grad]}"]  # fmt: skip
        for i, held in enumerate(self.states):
            out += held.defines(f"S{i + 1}")
        return out + [f"-DSC_{k.upper()}={i}" for i, k in enumerate(SCALARS[self.optimizer])]


def scalars(kind: StepKind, group: dict, state: dict) -> list[float]:
    """The step's scalars by name, from the group's hyperparameters and the step count (the
    ones torch's own loop computes in double), then each state's largest code."""
    lr, sign = float(group["lr"]), -1.0 if group.get("maximize") else 1.0
    if kind.optimizer == "adam":
        beta1, beta2 = (float(b) for b in group["betas"])
        wd, t = float(group["weight_decay"]), float(state["step"]) + 1
        named = {"decay": 1 - lr * wd if kind.decoupled else 1.0,
                 "coupled_wd": 0.0 if kind.decoupled else wd, "sign": sign,
                 "one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
                 "neg_step_size": -lr / (1 - beta1**t), "sqrt_bc2": math.sqrt(1 - beta2**t),
                 "eps": float(group["eps"])}  # fmt: skip
    else:
        named = {"sign": sign, "wd": float(group["weight_decay"]),
                 "momentum": float(group["momentum"]),
                 "one_minus_dampening": 1 - float(group["dampening"]), "neg_lr": -lr}  # fmt: skip
    return [named[k] for k in SCALARS[kind.optimizer]] + [h.largest for h in kind.states]


class Choice(NamedTuple):
    """Which backend steps a parameter, the kind it steps, and why."""

    backend: str  # "c", "compiled" or "chunk"
    kind: StepKind | None
    reason: str


def _chunk(reason: str) -> Choice:
    return Choice("chunk", None, reason)


def _stored(key: str, want: Any, local: Tensor) -> Held | str:
    """How the recipe stores state ``key`` of weight ``local`` (``want``: the policy's dtype or
    code format), or why only the reference steps it."""
    if not isinstance(want, str):
        return Held(dtype=want)
    if not quantizable(local):
        return Held(dtype=torch.float32)  # too small for codes: kept in fp32
    if want == "4-bit" and (local.numel() // local.shape[0]) % 2:
        return "4-bit codes of an odd row length"
    return Held(fmt=want, kind=kind_of(key))


def _held(t: Any, want: Held, local: Tensor) -> Held | str:
    """How state ``t`` is held where the recipe stores it as ``want``, or why only the reference
    steps it; fp32 values where codes are wanted (saved decoded) are coded by this step."""
    if isinstance(t, QuantizedState):
        if (t.fmt, t.kind, t.shape, t.device) != (want.fmt, want.kind, local.shape, local.device):
            return f"a state held as {t.fmt} codes of another shape, device or format"
        return want
    same = isinstance(t, Tensor) and (t.shape, t.device) == (local.shape, local.device)
    if not same or not t.is_contiguous():
        return "a state of another shape, device or layout"
    if want.fmt is not None and t.dtype == torch.float32:
        return want._replace(from_fp32=True)
    if t.dtype != want.dtype:
        return f"a state held in {t.dtype} where the recipe stores {want.fmt or want.dtype}"
    return want


def _states(optimizer: Any, group: dict, state: dict, policy: Any, local: Tensor) -> Any:
    """The states' :class:`Held` (a first step's as the recipe stores them: zeros, as torch's
    optimizers start them), or why only the reference steps them."""
    adam = isinstance(optimizer, Adam)
    names = _NAMES["adam"] if adam else _NAMES["sgd"] if group.get("momentum") else ()
    if not state and names and group.get("dampening"):
        return "its first step with dampening (torch's buffer starts as the gradient itself)"
    if state:
        keys = set(state) - {"step"} if adam else set(state)
        if keys != set(names):
            return f"optimizer state keys {sorted(state)}"
        step = state.get("step")
        if adam and not (isinstance(step, Tensor) and step.numel() == 1):
            return "a step count that is not a one-element tensor"
    held = []
    for k in names:
        h = _stored(k, policy(k, local.dtype), local)
        h = _held(state[k], h, local) if state and isinstance(h, Held) else h
        if isinstance(h, str):
            return f"{k}: {h}"
        held.append(h)
    return tuple(held)


def _refusal(optimizer: Any, group: dict, local: Tensor, g: Tensor, update: str) -> str | None:
    """Why no backend but the reference steps this optimizer's 16-bit parameter (``local`` and
    its dense gradient ``g`` as this rank holds them), or None."""
    if type(optimizer) not in (Adam, AdamW, SGD):
        return f"{type(optimizer).__name__} has no one-pass step (Adam, AdamW and SGD have)"
    if group.get("amsgrad"):
        return "amsgrad (its running maximum is a third state)"
    if group.get("differentiable") or group.get("capturable"):
        return "a differentiable or capturable group"
    if group.get("fused") is False or group.get("foreach") is False:
        return "the group asks for torch's for-loop (fused=False or foreach=False)"
    if update == "stochastic" and local.dtype != torch.bfloat16:
        return "stochastic rounding of a float16 weight"
    if not local.is_contiguous() or local.numel() < 2:
        return "a non-contiguous weight, or one of fewer than 2 elements"
    if g.dtype not in _FLOATS:
        return f"a {g.dtype} gradient"
    if not g.is_contiguous() or g.shape != local.shape or g.device != local.device:
        return "a gradient of another layout, shape or device than its weight"
    return None


def choose(updater: Any, group: dict, p: Tensor, local: Tensor, failed: set) -> Choice:
    """Which backend steps ``p`` (a 16-bit parameter of ``group`` of ``updater``, the
    :class:`~mixprec._core.update.modes.ModeUpdater`; ``local``: its tensor on this rank) this
    step, and why; ``failed``: the kinds whose build failed here."""
    optimizer, kernels = updater.optimizer, updater.fused.kernels
    if kernels == "torch":
        return _chunk("the recipe's kernels='torch'")
    backend = CPU_BACKEND if local.device.type == "cpu" else "compiled"
    if backend == "chunk":
        return _chunk("mixprec._core.update.spec.CPU_BACKEND is 'chunk'")
    if backend == "compiled" and local.numel() < MIN_NUMEL:
        return _chunk(f"{local.numel()} elements: below the {MIN_NUMEL} a compile is worth")
    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    why = _refusal(optimizer, group, local, g, updater.update)
    if why is not None:
        return _chunk(why)
    states = _states(optimizer, group, optimizer.state.get(p) or {}, updater._dtype_for, local)
    if isinstance(states, str):
        return _chunk(states)
    adam = isinstance(optimizer, Adam)
    kind = StepKind(
        "adam" if adam else "sgd",
        updater.update,
        local.dtype,
        g.dtype,
        states,
        decoupled=bool(group.get("decoupled_weight_decay", isinstance(optimizer, AdamW))),
        momentum=bool(states) and not adam,
        nesterov=bool(group.get("nesterov")),
    )
    if kind in failed:
        return _chunk(f"the {backend} build of this kind failed here")
    return Choice(backend, kind, "one pass")
