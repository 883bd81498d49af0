"""The one-pass update's steps written in torch ops, for :func:`torch.compile`.

:func:`build` makes the step of one :class:`.spec.StepKind`, reading its scalars by name
(:func:`.spec.index`); :mod:`.fused` compiles it once per kind, and inductor turns it into one
loop: Triton on a GPU, C++ on a CPU. The formulas are the eager ones of torch's single-tensor
optimizers, :mod:`.state_codes` and :mod:`.rounding`, op for op; ``c_loop.c`` writes the
same expressions in C. Two pitfalls of compiling them are handled here: inductor drops
``float(bf16(w))`` as a no-op round trip unless ``emulate_precision_casts`` is set (Kahan's
residual needs it, see :data:`OPTIONS`), and it multiplies by the reciprocal of a
loop-invariant divisor, which moves a block scale by an ulp (:func:`_div` divides in float64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec._core.update.spec import Held, StepKind, index
from mixprec._core.update.state_codes import (
    _E4M3,
    _E4M3_MAX,
    _TINY,
    _blocked,
    _layout,
    _unblocked,
)

__all__ = ["OPTIONS", "build"]

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers, as in rounding
#: inductor would drop ``float(bf16(w))`` as a no-op round trip: Kahan's residual needs it kept
OPTIONS = {"emulate_precision_casts": True}


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


def _decoded(st: Any, held: Held, shape: tuple[int, int]) -> Tensor:
    """The fp32 values (``shape``: rows, row length) of a state: a tensor widened, or codes and
    scales (``st`` = (codes, scale)) decoded as :meth:`QuantizedState.dequantize` does."""
    if isinstance(st, Tensor):
        return st.float()
    if held.from_fp32:  # fp32 now, codes from this step on
        return st[0].float()
    codes, scale = st
    fmt, kind = held.fmt, held.kind
    bits, mag, m, emin = _layout(fmt, kind)
    if fmt == "8-bit" and kind == "signed":
        vals = _blocked(codes.view(_E4M3).view(shape).float(), shape)
        return _unblocked(vals * scale.view(*vals.shape[:-1], 1), shape)
    if bits == 8:
        code = codes.view(shape).to(torch.int32)
    else:  # two codes per byte, low nibble first (an even row length: see spec)
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


def _store(st: Any, held: Held, x: Tensor, shape: tuple[int, int], div: Tensor) -> None:
    """Write fp32 ``x`` into a state: a tensor rounded to its dtype, or codes and scales as
    :meth:`QuantizedState.store_` computes them. ``div``: the largest code's value (448 for
    E4M3), a tensor input, so no constant is folded into a reciprocal (see :func:`_div`)."""
    if isinstance(st, Tensor):
        st.copy_(x)
        return
    codes, scale = st[-2:]
    fmt, kind = held.fmt, held.kind
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


def build(kind: StepKind) -> Callable[..., None]:
    """The step of ``kind``: ``step(w, comp, g, *states, sc, base, mix)`` (one state ``None``
    for plain SGD)."""
    i, (h1, h2) = index(kind.optimizer), (*kind.states, Held(), Held())[:2]
    if kind.optimizer == "adam":

        def step(w, comp, g, m, v, sc, base, mix):  # type: ignore[no-untyped-def]
            w32 = w.float() if comp is None else w.float() + comp.float()
            g32 = g.float() * sc[i["sign"]]
            if kind.decoupled:
                w32 = w32 * sc[i["decay"]]
            else:  # torch skips a zero weight decay
                wd = sc[i["coupled_wd"]]
                g32 = torch.where(wd != 0, g32 + w32 * wd, g32)
            m32 = torch.lerp(_decoded(m, h1, w.shape), g32, sc[i["one_minus_beta1"]])
            v32 = _decoded(v, h2, w.shape) * sc[i["beta2"]] + sc[i["one_minus_beta2"]] * g32 * g32
            denom = v32.sqrt() / sc[i["sqrt_bc2"]] + sc[i["eps"]]
            w32 = w32 + sc[i["neg_step_size"]] * (m32 / denom)
            _store(m, h1, m32, w.shape, sc[len(i)])
            _store(v, h2, v32, w.shape, sc[len(i) + 1])
            _write_weight(kind.update, w, comp, w32, base, mix)

        return step

    def sgd_step(w, comp, g, buf, sc, base, mix):  # type: ignore[no-untyped-def]
        w32 = w.float() if comp is None else w.float() + comp.float()
        g32 = g.float() * sc[i["sign"]]
        g32 = torch.where(sc[i["wd"]] != 0, g32 + w32 * sc[i["wd"]], g32)  # torch skips wd 0
        if kind.momentum:
            mom = sc[i["momentum"]]
            b32 = _decoded(buf, h1, w.shape) * mom + g32 * sc[i["one_minus_dampening"]]
            _store(buf, h1, b32, w.shape, sc[len(i)])
            g32 = g32 + b32 * mom if kind.nesterov else b32
        w32 = w32 + g32 * sc[i["neg_lr"]]
        _write_weight(kind.update, w, comp, w32, base, mix)

    return sgd_step
