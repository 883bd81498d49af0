"""Fused 16-bit updates: one compiled pass over a parameter's memory per step.

Design (``docs/design.md``, "Lean 16-bit updates"). The chunk path of
:class:`~mixprec._core.update.lean.LeanUpdate` widens weights, gradients and states into fp32
temporaries, lets the wrapped optimizer step them, then narrows and rounds them back: five or
six passes over memory. For the optimizers whose math is known -- torch's ``Adam``, ``AdamW``
and ``SGD`` (momentum, nesterov, dampening, weight decay, maximize) -- this module does the
same step in one function that :func:`torch.compile` turns into one loop (vectorized C++ on a
CPU, Triton on a GPU). Other optimizers, and every case listed under "falls back", keep the
chunk path.

One bf16 parameter ``p`` of ``n`` elements, AdamW, ``update="kahan"``, states ``"auto"``
(``exp_avg`` bf16, ``exp_avg_sq`` fp32), at step ``t``:

1. Host: ``state["step"] += 1`` (the same tensor torch keeps); from it and the group's
   ``lr``, ``betas``, ``eps``, ``weight_decay`` the scalars torch's own loop computes in double
   (``lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)``, ``1 - lr * wd``) go into one small fp32
   tensor. Hyperparameters and the step count are *tensor* inputs, so a new lr (a schedule)
   or step never recompiles.
2. One compiled call on 1-D views of ``p``, its compensation ``c``, ``p.grad``, ``exp_avg``
   and ``exp_avg_sq`` (flattened: every size is one dynamic shape class, so one graph per
   kind of step, not per parameter). Per element: ``w = float(p) + float(c)``; ``w *= 1 - lr *
   wd``; ``m = lerp(float(m), g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g * g``;
   ``w -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)``; then ``p = bf16(w)``, ``c = bf16(w -
   float(p))``, ``m = bf16(m)``, ``v`` stored -- 2 + 2 + 2 + 2 + 4 bytes read, 2 + 2 + 2 + 4
   written, once each.
3. ``"stochastic"`` instead adds 16 random bits to ``w``'s bit pattern and truncates, the bits
   being the hash of (seed, step, parameter, global element index) that
   :mod:`mixprec._core.update.rounding` computes, evaluated inside the loop in int64 (each 32-bit
   product split so nothing overflows): the same bits as the chunk path, so the rounding stays
   unbiased and chunk-, bucket- and shard-invariant. ``"nearest"`` rounds ``w`` to nearest.

Numerics: the same formula on the same fp32 operands as torch's single-tensor loop; against
the default chunk path (torch's fused fp32 kernel by default) it differs by fp32
rounding order only (``tests/core/test_fused_update.py`` bounds the difference after 100 steps
in ulps of the 16-bit weight). A skipped step never reaches the updater, so nothing moves.

8-bit and 4-bit states (:mod:`mixprec._core.update.state_codes`) are decoded and re-coded inside the
same function, on (rows, row length) views so that the blocks of 256 stay inside one row: the
codes are read once and written once, with one extra reduction (each block's largest value)
before they are written. The decode and encode are the eager ones, op for op
(:mod:`.fused_ops`).

Falls back to the chunk path (per parameter, silently, as a choice of kernel): a parameter's
first step (the optimizer makes its state), a group built with ``fused=False`` or
``foreach=False`` (the user's choice of torch's loop), ``amsgrad``, ``capturable``,
``differentiable``, a
state stored other than ``state_dtype`` says (e.g. a resumed fp32 state the next chunk step
narrows to 16 bits), 4-bit codes of an odd row length, fp16 with ``"stochastic"``,
non-contiguous tensors,
complex or sparse gradients, an optimizer subclass. Where :func:`torch.compile` or the C loop is
unavailable or fails (no C or C++ compiler, a dtype the backend lacks) the chunk path takes
over and a warning says so once.

When: the recipe's ``kernels`` (``"auto"``, the default; ``"torch"`` never compiles an
update). Where the step runs: on a GPU, :func:`torch.compile` of :mod:`.fused_ops` (Triton);
on a CPU, :mod:`.cpu_kernels` (:data:`CPU_KERNELS`): the same expressions as a C loop the
machine's compiler vectorizes, because inductor's C++ for them was compute-bound (AdamW +
Kahan: 1.8 ms per million bf16 elements against the C loop's 0.7 on a Zen 4 EPYC, one thread;
with 8-bit states 27 ms against 1.4). ``"auto"`` fuses parameters of at least
:data:`MIN_NUMEL` elements where a first call compiles a graph (smaller ones are not worth
it; a C loop fuses every size) and, where inductor would step coded states on a CPU, leaves
them to the chunk path. :data:`MODE` is the process-wide switch under the recipes: ``"auto"``,
``"on"`` (every parameter it can: for tests) or ``"off"`` (the test suite's, which fuses only
where it tests this module).

A state held in fp32 where codes are wanted (a checkpoint that saved it decoded, see
:mod:`mixprec.distributed`) is read as fp32 by the fused step and written as codes, as the
chunk path's next step does, so a resume repeats the uninterrupted run bit for bit.
"""

from __future__ import annotations

import math
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer

from mixprec._core._warnings import MixprecPerformanceWarning, user_stacklevel
from mixprec._core.update.fused_ops import OPTIONS, adam, sgd
from mixprec._core.update.release import all_finite
from mixprec._core.update.rounding import round_keys, shard_offset
from mixprec._core.update.state_codes import (
    _E4M3_MAX,
    QuantizedState,
    _largest,
    _layout,
    kind_of,
    quantizable,
)

__all__ = ["MIN_NUMEL", "MODE", "FusedUpdates"]

#: "auto" | "on" | "off": the process-wide switch under the recipes' ``kernels``
MODE = "auto"
#: "c" | "inductor": what runs the step on a CPU (:mod:`.cpu_kernels`, or torch.compile's C++)
CPU_KERNELS = "c"
#: in "auto", parameters below this many elements keep the chunk path
MIN_NUMEL = 2**16

_LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_LOW)
_MASK = 0xFFFFFFFF
#: compile key -> compiled step, shared by every updater of the process
_COMPILED: dict[tuple, Callable[..., None]] = {}
#: compile keys whose compile failed here: the chunk path steps them
_FAILED: set[tuple] = set()


# --------------------------------------------------------------------------- the dispatcher


def _divisors(stores: tuple) -> list[float]:
    """Each state's largest code value (1.0 for a plain tensor): see :func:`_store`."""
    out = []
    for st in stores:
        if not isinstance(st, tuple):
            out.append(1.0)
        elif st[:2] == ("8-bit", "signed"):
            out.append(_E4M3_MAX)
        else:
            out.append(_largest(*_layout(*st[:2])[1:]))
    return out


def _operand(st: Any, store: Any, view: tuple[int, ...]) -> tuple[Any, Any]:
    """A state as the kernel takes it, and the state to keep after the step (None: ``st``):
    a tensor viewed as ``view``; (codes, scale, format, kind) of a :class:`QuantizedState`;
    (fp32 values, codes, scale, format, kind) where an fp32 state becomes codes this step."""
    if isinstance(st, QuantizedState):
        return (st.codes, st.scale, st.fmt, st.kind), None
    if isinstance(store, tuple):
        q = QuantizedState.empty(st.shape, store[0], store[1], st.device)
        return (st.view(view), q.codes, q.scale, q.fmt, q.kind), q
    return st.view(view), None


def _stores(
    state: dict, names: tuple[str, ...], dtype_for: Callable[[str], Any], local: Tensor
) -> list[Any] | None:
    """How each of ``names`` is held, as a compile key lists it: a dtype, (format, kind) of
    codes, or (format, kind, "fp32") for an fp32 state that becomes codes this step; None
    where a state is held in a way only the chunk path steps."""
    stores: list[Any] = []
    for k in names:
        t = state[k]
        want = dtype_for(k)
        if isinstance(t, QuantizedState):
            if (
                t.fmt != want
                or t.shape != local.shape
                or t.device != local.device
                or (t.fmt == "4-bit" and (local.numel() // local.shape[0]) % 2)
            ):
                return None
            stores.append((t.fmt, t.kind))
            continue
        if isinstance(want, str):  # codes wanted: only where too small for them
            want = want if quantizable(t) else torch.float32
        if (
            not isinstance(t, Tensor)
            or t.shape != local.shape
            or t.device != local.device
            or not t.is_contiguous()
        ):
            return None
        if isinstance(want, str) and t.dtype == torch.float32:
            # codes wanted, fp32 held (a checkpoint's decoded state): read as it is, written
            # as codes, as the chunk path's next step does
            if want == "4-bit" and (local.numel() // local.shape[0]) % 2:
                return None
            stores.append((want, kind_of(k), "fp32"))
            continue
        if t.dtype != want:  # e.g. loaded wider than stored: the chunk path narrows
            return None
        stores.append(t.dtype)
    return stores


def _own_code(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with a code object of its own. Dynamo keeps the graphs it compiled per code
    object, at most ``recompile_limit`` (8) of them, and every kind of step built by
    :func:`_adam` or :func:`_sgd` shares its builder's code: past eight kinds in a process the
    next one failed to compile. A copy per kind keeps each kind's graph apart."""
    code = fn.__code__
    own = code.replace(co_name=f"{code.co_name}_{len(_COMPILED) + len(_FAILED)}")
    return types.FunctionType(own, fn.__globals__, own.co_name, fn.__defaults__, fn.__closure__)


class FusedUpdates:
    """Steps the parameters it can take with one compiled pass each (see the module
    docstring); :meth:`step` returns the ones left to the chunk path."""

    def __init__(self, update: str, kernels: str = "auto") -> None:
        self.update = update
        self.kernels = kernels  # the recipe's: "torch" leaves every parameter to the chunks
        self.broken: str | None = None  # why compile failed (then everything falls back)
        self.compile_seconds = 0.0  # first calls of each graph (compile), for benchmarks
        self.fused_steps = 0  # parameters stepped here, for tests and benchmarks

    # -- what can be fused ------------------------------------------------------------------
    def _kind(self, lean: Any, group: dict, p: Tensor, local: Tensor) -> Any:
        """The compile key of ``p``'s step, or None to leave it to the chunk path."""
        optimizer = lean.optimizer
        mode = "off" if self.kernels == "torch" else MODE
        if mode == "off":
            return None
        c_loop = local.device.type == "cpu" and CPU_KERNELS == "c"
        if mode != "on" and local.numel() < MIN_NUMEL and not c_loop:
            return None  # not worth a compile (a C loop has no compile per size)
        if type(optimizer) not in (Adam, AdamW, SGD):
            return None
        if group.get("differentiable") or group.get("capturable"):
            return None
        if group.get("fused") is False or group.get("foreach") is False:
            return None  # the user chose torch's loop: respected, as torch_fused does
        low = local.dtype
        if low not in _LOW or (self.update == "stochastic" and low != torch.bfloat16):
            return None
        g = p.grad
        if (
            g is None
            or g.is_sparse
            or g.dtype not in _FLOATS
            or not local.is_contiguous()
            or local.numel() < 2  # one shape class: 1-D of n >= 2 (0 and 1 specialise)
        ):
            return None
        g = g.to_local() if hasattr(g, "to_local") else g
        if not g.is_contiguous() or g.shape != local.shape or g.device != local.device:
            return None
        state = optimizer.state.get(p) or {}
        names = ("exp_avg", "exp_avg_sq") if isinstance(optimizer, Adam) else ("momentum_buffer",)
        if isinstance(optimizer, SGD) and not group.get("momentum"):
            names = ()  # plain SGD keeps no state
        elif not state:
            return None  # the first step: the optimizer makes the state
        if isinstance(optimizer, Adam):
            if group.get("amsgrad") or set(state) != {"step", *names}:
                return None
            s = state["step"]
            if not isinstance(s, Tensor) or s.device.type != "cpu":
                return None
        elif set(state) - {"momentum_buffer"} or len(state) != len(names):
            return None
        stores = _stores(state, names, lambda k: lean._dtype_for(k, low), local)
        if stores is None:
            return None
        if (
            mode == "auto"
            and local.device.type == "cpu"
            and CPU_KERNELS == "inductor"
            and any(isinstance(d, tuple) for d in stores)
        ):
            return None  # codes in inductor's C++ ran 2.3x slower than the eager chunk path
        if isinstance(optimizer, Adam):
            decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, AdamW)))
            key = ("adam", self.update, decoupled, low, g.dtype, *stores)
        else:
            key = ("sgd", self.update, bool(names), bool(group.get("nesterov")), low, g.dtype,
                   *stores)  # fmt: skip
        return None if key in _FAILED else key

    def finite(self, g: Tensor) -> bool:
        """Whether every element of gradient ``g`` is finite: one C pass where this updater
        would step ``g``'s parameter with a C loop, torch ops otherwise."""
        if self.kernels != "torch" and MODE != "off" and CPU_KERNELS == "c":
            from mixprec._core.update import cpu_kernels

            done = cpu_kernels.all_finite(g)
            if done is not None:
                return done
        return all_finite(g)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lean: Any, group: dict, params: list[Tensor]) -> list[Tensor]:
        """Step what can be fused of ``params`` (of ``group`` of ``lean``, the
        :class:`~mixprec._core.update.lean.LeanUpdate`); return those left to the chunk path."""
        rest = []
        optimizer = lean.optimizer
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            kind = self._kind(lean, group, p, local)
            if kind is None or not self._run(kind, optimizer, group, p, local,
                                             lean.compensation.get(p), lean.seed, lean.steps,
                                             lean._ordinal):  # fmt: skip
                rest.append(p)
        return rest

    def _run(
        self,
        kind: tuple,
        optimizer: Optimizer,
        group: dict,
        p: Tensor,
        local: Tensor,
        comp: Tensor | None,
        seed: int,
        steps: int,
        ordinal: dict[int, int],
    ) -> bool:
        device = local.device
        state = optimizer.state[p]
        # 1-D views (every size one shape class); (rows, row length) where codes keep blocks
        coded = any(isinstance(x, tuple) for x in kind)
        view = (local.shape[0], local.numel() // local.shape[0]) if coded else (-1,)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        lr = float(group["lr"])
        sign = -1.0 if group.get("maximize") else 1.0
        if kind[0] == "adam":
            beta1, beta2 = (float(b) for b in group["betas"])
            wd, eps = float(group["weight_decay"]), float(group["eps"])
            t = float(state["step"]) + 1
            decoupled = kind[2]
            names, stores = ("exp_avg", "exp_avg_sq"), kind[5:]
            scalars = [1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, sign,
                       1 - beta1, beta2, 1 - beta2, -lr / (1 - beta1**t),
                       math.sqrt(1 - beta2**t), eps]  # fmt: skip
        else:
            momentum = float(group["momentum"])
            names, stores = ("momentum_buffer",)[: len(kind[6:])], kind[6:]
            scalars = [sign, float(group["weight_decay"]), momentum,
                       1 - float(group["dampening"]), -lr]  # fmt: skip
        scalars += _divisors(stores)
        operands = [_operand(state[k], st, view) for k, st in zip(names, stores)]
        tensors = [x for x, _ in operands] or [None]
        sc = torch.tensor(scalars, dtype=torch.float32, device=device)
        keys = (0, 0)
        if self.update == "stochastic":
            key, m = round_keys(seed, steps, ordinal[id(p)])
            keys = ((shard_offset(p) + key) & _MASK, m & _MASK)
        comp = None if comp is None else comp.view(view)
        args = (local.view(view), comp, g.view(view), *tensors, sc)
        if device.type == "cpu" and CPU_KERNELS == "c":
            ok = self._run_c(kind, args, coded, keys)
        else:
            ok = self._run_compiled(kind, args, keys)
        if not ok:
            return False
        for k, (_, coded_now) in zip(names, operands):
            if coded_now is not None:
                state[k] = coded_now
        if kind[0] == "adam" and device.type == "cpu" and CPU_KERNELS == "c":
            from mixprec._core.update.cpu_kernels import count_step

            count_step(state["step"])
        elif kind[0] == "adam":
            state["step"].add_(1)
        self.fused_steps += 1
        return True

    def _run_c(self, kind: tuple, args: tuple, coded: bool, keys: tuple[int, int]) -> bool:
        """The step through :mod:`.cpu_kernels` (a C loop); False where it cannot be built."""
        from mixprec._core.update import cpu_kernels

        w, comp, g, *states, sc = args
        first = kind not in cpu_kernels._STEPS  # its library is built (or loaded) now
        t0 = time.perf_counter()
        try:
            cpu_kernels.kernel(kind)
        except Exception as exc:  # noqa: BLE001 -- no C compiler, a failed build, ...
            return self._failed(kind, exc)
        if first:
            self.compile_seconds += time.perf_counter() - t0
        rows, cols = (w.shape[0], w.shape[1]) if coded else (1, w.numel())
        states = [  # (codes, scale[, fp32 values read this once]) or a tensor
            (st[1], st[2], st[0]) if isinstance(st, tuple) and len(st) == 5
            else st[:2] if isinstance(st, tuple) else st
            for st in states
            if st is not None
        ]  # fmt: skip
        cpu_kernels.run(kind, rows, cols, (w, comp, g), states, sc, *keys)
        return True

    def _run_compiled(self, kind: tuple, args: tuple, keys: tuple[int, int]) -> bool:
        """The step through :func:`torch.compile` (Triton on a GPU, C++ on a CPU)."""
        device = args[0].device
        base, mix = (torch.tensor(k, dtype=torch.int64, device=device) for k in keys)
        fn = _COMPILED.get(kind)
        first = fn is None
        if first:
            build = (
                adam(self.update, kind[2])
                if kind[0] == "adam"
                else sgd(self.update, kind[2], kind[3])
            )
            fn = torch.compile(_own_code(build), dynamic=True, fullgraph=True, options=OPTIONS)
        t0 = time.perf_counter()
        try:
            fn(*args, base, mix)
        except Exception as exc:  # no compiler, an unsupported dtype on this backend, ...
            if not first:
                raise
            return self._failed(kind, exc)
        if first:
            _COMPILED[kind] = fn
            self.compile_seconds += time.perf_counter() - t0
        return True

    def _failed(self, kind: tuple, exc: Exception) -> bool:
        """Leave ``kind`` to the chunk path from now on, and say so once."""
        _FAILED.add(kind)
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            warnings.warn(
                "mixprec's fused update could not be compiled here "
                f"({self.broken}); update modes use the chunked eager path "
                "(correct, slower). A recipe with kernels='torch' skips the attempt.",
                MixprecPerformanceWarning,
                stacklevel=user_stacklevel(),
            )
        return False
