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
before they are written. The decode and encode are the eager ones, op for op; divisions go
through float64 (:func:`_div`) so that inductor's reciprocal-multiply does not move a scale.

Falls back to the chunk path (per parameter, silently, as a choice of kernel): a parameter's
first step (the optimizer makes its state), ``amsgrad``, ``capturable``, ``differentiable``, a
state stored other than ``state_dtype`` says (a resumed fp32 state the next chunk step narrows),
4-bit codes of an odd element count, fp16 with ``"stochastic"``, non-contiguous tensors,
complex or sparse gradients, an optimizer subclass. Where :func:`torch.compile` is
unavailable or fails (no C++ compiler, a dtype the backend lacks) the chunk path takes over and
a warning says so once.

When: the recipe's ``kernels`` (``"auto"``, the default; ``"torch"`` never compiles an
update). ``"auto"`` fuses parameters of at least :data:`MIN_NUMEL` elements (smaller ones are
not worth a first-step compile) and, on a CPU, only those without coded states: inductor's C++
for the decode / block-max / encode ran 2.3x slower than the eager chunk path on a Zen 4 EPYC
(4 x 1024 x 1024, AdamW, 8-bit: 160 ms against 70 ms a step), so codes stay eager there until
that kernel is better. :data:`MODE` is the process-wide switch under the recipes: ``"auto"``,
``"on"`` (every parameter it can, codes included: for tests) or ``"off"`` (the test suite's,
which compiles only where it tests this module).
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
from mixprec._core.update.rounding import round_keys, shard_offset
from mixprec._core.update.state_codes import (
    _E4M3,
    _E4M3_MAX,
    _TINY,
    QuantizedState,
    _blocked,
    _largest,
    _layout,
    _unblocked,
    quantizable,
)

__all__ = ["MIN_NUMEL", "MODE", "FusedUpdates"]

#: "auto" | "on" | "off": the process-wide switch under the recipes' ``kernels``
MODE = "auto"
#: in "auto", parameters below this many elements keep the chunk path
MIN_NUMEL = 2**16

_LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_LOW)
_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers, as in rounding
#: inductor would drop ``float(bf16(w))`` as a no-op round trip: Kahan's residual needs it kept
_OPTIONS = {"emulate_precision_casts": True}
#: compile key -> compiled step, shared by every updater of the process
_COMPILED: dict[tuple, Callable[..., None]] = {}
#: compile keys whose compile failed here: the chunk path steps them
_FAILED: set[tuple] = set()


# --------------------------------------------------------------------------- the kernels


def _mul32(h: Tensor, k: int) -> Tensor:
    """``h * k mod 2**32`` for int64 ``h`` in [0, 2**32): the product split in 16-bit halves of
    ``k`` so no int64 product overflows."""
    return (h * (k & 0xFFFF) + (((h * (k >> 16)) & 0xFFFF) << 16)) & _MASK


def _random_bits(n: int, base: Tensor, mix: Tensor, device: torch.device, bits: int) -> Tensor:
    """:func:`mixprec._core.update.rounding.keyed_bits_` for one segment (``base`` = global offset +
    key, ``mix``), in int64: the same ``bits`` random bits per element."""
    h = (torch.arange(n, device=device, dtype=torch.int64) + base) & _MASK
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 15)
    h = h ^ mix
    h = _mul32(h, _M2)
    return h >> (32 - bits)


def _decoded(st: Any, shape: tuple[int, int]) -> Tensor:
    """The fp32 values (``shape``: rows, row length) of a state: a tensor widened, or codes
    and scales decoded as :meth:`QuantizedState.dequantize` does (``st`` = (codes, scale,
    format, kind))."""
    if isinstance(st, Tensor):
        return st.float()
    codes, scale, fmt, kind = st
    bits, mag, m, emin = _layout(fmt, kind)
    if fmt == "8-bit" and kind == "signed":
        vals = _blocked(codes.view(_E4M3).view(shape).float(), shape)
        return _unblocked(vals * scale.view(*vals.shape[:-1], 1), shape)
    if bits == 8:
        code = codes.view(shape).to(torch.int32)
    else:  # two codes per byte, low nibble first (an even count: see _kind)
        c = codes.to(torch.int32)
        code = torch.stack((c & 15, c >> 4), dim=-1).view(shape)
    code = _blocked(code, shape)
    icode = code & (2**mag - 1) if kind == "signed" else code
    vals = ((icode + (((127 + emin) << m) - 1)) << (23 - m)).view(torch.float32)
    vals = vals * scale.view(*code.shape[:-1], 1)
    if kind == "signed":
        sign = 1 - 2 * (code >> mag).to(torch.float32)
        vals = torch.where(icode == 0, 0.0, vals) * sign
    else:
        vals = vals * vals
    return _unblocked(vals, shape)


def _div(a: Any, b: Any) -> Tensor:
    """fp32 ``a / b`` correctly rounded, as eager torch divides: in float64, then rounded (exact:
    float64 holds more than twice fp32's bits). Inductor would hoist a loop-invariant divisor's
    reciprocal and multiply, which moves a block scale by an ulp."""
    a = a.double() if isinstance(a, Tensor) else a
    b = b.double() if isinstance(b, Tensor) else b
    return (a / b).float()


def _store(st: Any, x: Tensor, shape: tuple[int, int], div: Tensor) -> None:
    """Write fp32 ``x`` into a state: a tensor rounded to its dtype, or codes and scales as
    :meth:`QuantizedState.store_` computes them. ``div``: the largest code's value (448 for
    E4M3), a tensor input, so no constant is folded into a reciprocal (see :func:`_div`)."""
    if isinstance(st, Tensor):
        st.copy_(x)
        return
    codes, scale, fmt, kind = st
    bits, mag, m, emin = _layout(fmt, kind)
    v = _blocked(x, shape)
    if kind == "sqrt":
        v = v.clamp(min=0).sqrt()
    amax = v.amax(dim=-1, keepdim=True)
    if kind == "signed":
        amax = torch.maximum(amax, v.amin(dim=-1, keepdim=True).neg())
    amax = torch.where(amax < _TINY, 0.0, amax)
    if fmt == "8-bit" and kind == "signed":
        scale.copy_(_div(amax.view(-1), div))
        q = (v * torch.where(amax > 0, _div(_E4M3_MAX, amax), 0.0)).clamp(-_E4M3_MAX, _E4M3_MAX)
        codes.view(_E4M3).view(shape).copy_(_unblocked(q, shape))
        return
    sc = _div(amax, div)
    scale.copy_(sc.view(-1))
    a = v.abs() * torch.where(sc > 0, _div(1.0, sc), 0.0)
    shift = 23 - m
    i = a.view(torch.int32) + ((1 << (shift - 1)) - (((127 + emin) << m) - 1 << shift))
    code = (i >> shift).clamp(0 if kind == "signed" else 1, 2**mag - 1)
    if kind == "signed":
        code = code | ((v < 0).to(torch.int32) << mag)
    code = _unblocked(code, shape).reshape(-1)
    if bits == 8:
        codes.copy_(code.to(torch.uint8))
    else:
        pairs = code.view(-1, 2)
        codes.copy_((pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8))


def _write_weight(
    update: str, w: Tensor, comp: Tensor | None, w32: Tensor, base: Tensor, mix: Tensor
) -> None:
    if update == "stochastic":  # bf16: add 16 random bits below the mantissa, truncate
        r = _random_bits(w32.numel(), base, mix, w32.device, 16).view(w32.shape)
        b = ((w32.view(torch.int32).to(torch.int64) + r) & -65536).to(torch.int32)
        w.copy_(b.view(torch.float32))  # exactly a bf16 value: the copy is lossless
        return
    low = w32.to(w.dtype)
    w.copy_(low)
    if comp is not None:  # Kahan: the residual, exact in fp32, kept in 16 bits
        comp.copy_(w32 - low.float())


def _adam(update: str, decoupled: bool) -> Callable[..., None]:
    def step(w, comp, g, m, v, sc, base, mix):  # type: ignore[no-untyped-def]
        # sc: [1 - lr*wd (decoupled) or 1, wd (coupled) or 0, +-1 (maximize), 1 - beta1,
        #      beta2, 1 - beta2, -lr / bc1, sqrt(bc2), eps, m's and v's largest code]
        w32 = w.float() if comp is None else w.float() + comp.float()
        g32 = g.float() * sc[2]
        if decoupled:
            w32 = w32 * sc[0]
        else:
            g32 = g32 + w32 * sc[1]
        shape = w.shape
        m32 = torch.lerp(_decoded(m, shape), g32, sc[3])
        v32 = _decoded(v, shape) * sc[4] + sc[5] * g32 * g32
        w32 = w32 + sc[6] * (m32 / (v32.sqrt() / sc[7] + sc[8]))
        _store(m, m32, shape, sc[9])
        _store(v, v32, shape, sc[10])
        _write_weight(update, w, comp, w32, base, mix)

    return step


def _sgd(update: str, momentum: bool, nesterov: bool) -> Callable[..., None]:
    def step(w, comp, g, buf, sc, base, mix):  # type: ignore[no-untyped-def]
        # sc: [+-1 (maximize), wd, momentum, 1 - dampening, -lr, the buffer's largest code]
        w32 = w.float() if comp is None else w.float() + comp.float()
        g32 = g.float() * sc[0]
        g32 = g32 + w32 * sc[1]
        if momentum:
            b32 = _decoded(buf, w.shape) * sc[2] + g32 * sc[3]
            _store(buf, b32, w.shape, sc[5])
            g32 = g32 + b32 * sc[2] if nesterov else b32
        w32 = w32 + g32 * sc[4]
        _write_weight(update, w, comp, w32, base, mix)

    return step


# --------------------------------------------------------------------------- the dispatcher


def _divisors(state: dict, names: tuple[str, ...]) -> list[float]:
    """Each state's largest code value (1.0 for a plain tensor): see :func:`_store`."""
    out = []
    for k in names:
        st = state.get(k)
        if not isinstance(st, QuantizedState):
            out.append(1.0)
        elif st.fmt == "8-bit" and st.kind == "signed":
            out.append(_E4M3_MAX)
        else:
            out.append(_largest(*_layout(st.fmt, st.kind)[1:]))
    return out


def _view(st: Any, view: tuple[int, ...]) -> Any:
    """A state as the kernel takes it: a tensor viewed as ``view``, or (codes, scale, format,
    kind) of a :class:`QuantizedState`."""
    if isinstance(st, QuantizedState):
        return (st.codes, st.scale, st.fmt, st.kind)
    return st.view(view)


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
        optimizer, dtype_for = lean.optimizer, lean._dtype_for
        mode = "off" if self.kernels == "torch" else MODE
        if mode == "off":
            return None
        if mode != "on" and local.numel() < MIN_NUMEL:
            return None
        if type(optimizer) not in (Adam, AdamW, SGD):
            return None
        if group.get("differentiable") or group.get("capturable"):
            return None
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
        stores = []
        for k in names:
            t = state[k]
            want = dtype_for(k, low)
            if isinstance(t, QuantizedState):
                if (
                    t.fmt != want
                    or t.shape != local.shape
                    or t.device != local.device
                    or (t.fmt == "4-bit" and local.numel() % 2)
                ):
                    return None
                stores.append((t.fmt, t.kind))
                continue
            if isinstance(want, str):  # codes wanted: only where too small for them
                want = want if quantizable(t) else torch.float32
            if (
                not isinstance(t, Tensor)
                or t.dtype != want  # e.g. loaded wider than stored: the chunk path narrows
                or t.shape != local.shape
                or t.device != local.device
                or not t.is_contiguous()
            ):
                return None
            stores.append(t.dtype)
        if (
            mode == "auto"
            and local.device.type == "cpu"
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
            scalars = [1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, sign,
                       1 - beta1, beta2, 1 - beta2, -lr / (1 - beta1**t),
                       math.sqrt(1 - beta2**t), eps,
                       *_divisors(state, ("exp_avg", "exp_avg_sq"))]  # fmt: skip
            tensors = [_view(state[k], view) for k in ("exp_avg", "exp_avg_sq")]
        else:
            momentum = float(group["momentum"])
            scalars = [sign, float(group["weight_decay"]), momentum,
                       1 - float(group["dampening"]), -lr,
                       *_divisors(state, ("momentum_buffer",))]  # fmt: skip
            tensors = [_view(state["momentum_buffer"], view)] if kind[2] else [None]
        sc = torch.tensor(scalars, dtype=torch.float32, device=device)
        base = mix = None
        if self.update == "stochastic":
            key, m = round_keys(seed, steps, ordinal[id(p)])
            base = torch.tensor((shard_offset(p) + key) & _MASK, dtype=torch.int64, device=device)
            mix = torch.tensor(m & _MASK, dtype=torch.int64, device=device)
        else:  # unused, but the same graph inputs every call
            base = mix = torch.zeros((), dtype=torch.int64, device=device)
        fn = _COMPILED.get(kind)
        first = fn is None
        if first:
            build = (
                _adam(self.update, kind[2])
                if kind[0] == "adam"
                else _sgd(self.update, kind[2], kind[3])
            )
            fn = torch.compile(_own_code(build), dynamic=True, fullgraph=True, options=_OPTIONS)
        comp = None if comp is None else comp.view(view)
        args = (local.view(view), comp, g.view(view), *tensors, sc, base, mix)
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # no compiler, an unsupported dtype on this backend, ...
            if not first:
                raise
            _FAILED.add(kind)
            if self.broken is None:  # say so once
                self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                warnings.warn(
                    "mixprec's fused update could not be compiled here "
                    f"({self.broken}); update modes use the chunked eager path "
                    "(correct, slower). A recipe with kernels='torch' skips the attempt.",
                    MixprecPerformanceWarning,
                    stacklevel=user_stacklevel(),
                )
            return False
        if first:
            _COMPILED[kind] = fn
            self.compile_seconds += time.perf_counter() - t0
        if kind[0] == "adam":
            state["step"].add_(1)
        self.fused_steps += 1
        return True
