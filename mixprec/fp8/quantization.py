"""FP8 quantization: amax, scales, and casts that never hide an overflow.

Design: one small set of functions that every FP8 user in mixprec shares -- the FP8 matmuls of
the ``fp8=`` option and the FP8 copies of saved activations (``activations="fp8"``) -- so the
rounding, the scale rule and the handling of inf/NaN are written once.

* A tensor is stored as ``data`` (an FP8 dtype) and a float32 ``scale``, per tensor
  (``axis=None``) or per slice along ``axis`` (``axis=-1``: one scale per row, the last dim
  reduced). ``x ~= data.float() / scale``.
* The scale maps the slice's amax to the format's largest finite value (torchao's and
  Transformer Engine's rule: ``scale = fp8_max / amax``), optionally rounded down to a power of
  two, which makes scaling exact (only the FP8 rounding remains).
* **Overflow is never hidden.** torch's casts to ``float8_e4m3fn`` saturate (inf -> 448), so an
  inf would come back as a large finite number. Here a non-finite amax gives a zero (or NaN)
  scale, so the slice holding an inf or a NaN comes back as NaN everywhere: a loss or gradient
  computed from it is non-finite and a mixed-precision step is skipped, as for fp16 overflow.
  This costs no host synchronisation. Values are clamped to the format's range before the
  cast, because casts before torch 2.12 turn out-of-range values into NaN instead of
  saturating (rounding can put ``amax * scale`` a hair above the largest value).
* **Power-of-2 scales are exact and cheap.** Scaling by a power of two loses nothing, so it runs
  in the input's own dtype (no float32 copy) and needs no clamp (the scale is chosen so that
  ``amax * scale`` cannot exceed the largest value). Widening FP8 back is where CPUs are slow:
  torch's float8 -> bfloat16 cast took 3-4x as long as four integer passes that move the FP8
  bits into a bfloat16/float16/float32 bit pattern (exact for every finite value, subnormals
  included; EPYC, 2 threads), so :func:`dequantize` widens that way on CPUs.
* **One rule for where to slice.** On a CPU in eager mode a 2-D tensor is cast in slices of
  rows whose temporaries stay small (:func:`quantize_chunked`, :func:`dequantize_into`);
  elsewhere as one expression (compiled: one fused pass; eager on a GPU: a few kernels rather
  than a loop of them). :func:`quantize_2d` and :func:`dequantize_2d` make that choice for the
  FP8 Linear and the FP8 activations alike; the scales and data are the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_DTYPES",
    "Float8Data",
    "amax",
    "dequantize",
    "dequantize_2d",
    "dequantize_into",
    "quantize",
    "quantize_2d",
    "quantize_chunked",
    "scale_for",
    "sqnr",
]

E4M3 = torch.float8_e4m3fn  # forward operands and stored activations: 3 mantissa bits, max 448
E5M2 = torch.float8_e5m2  # gradients: range over precision, max 57344
FP8_DTYPES = (E4M3, E5M2)
_TINY = 1e-12  # amax floor: an all-zero slice gets a large finite scale, not inf


class Float8Data(NamedTuple):
    """An FP8 copy of a tensor: ``data`` (FP8) and ``scale`` (float32, broadcastable to it).

    ``power_of_2``: every scale is a power of two, so :func:`dequantize` is exact in any dtype.
    """

    data: Tensor
    scale: Tensor
    power_of_2: bool = False


def _check_fp8(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"Expected an FP8 dtype (torch.float8_e4m3fn or torch.float8_e5m2), received {dtype}."
        )


Axis = int | tuple[int, ...] | None


def amax(x: Tensor, axis: Axis = None) -> Tensor:
    """Largest magnitude of ``x`` in float32: one value (``axis=None``) or one per slice, the
    dims in ``axis`` reduced (kept with size 1). NaN anywhere in a slice gives NaN."""
    x = x.detach()
    bits = _MAGNITUDE_BITS.get(x.dtype) if x.device.type == "cpu" else None
    if bits is not None:  # the sign bit cleared: integers ordered as the magnitudes, NaN on top
        itype, mask = bits
        a = x.view(itype) & mask
        top = a.amax() if axis is None else a.amax(dim=axis, keepdim=True)
        return top.view(x.dtype).float()
    a = x.abs()
    return (a.amax() if axis is None else a.amax(dim=axis, keepdim=True)).float()


#: float dtype -> (integer dtype of its width, mask that clears the sign bit). Read as integers,
#: non-negative IEEE floats order as their values (inf above every finite value, NaN above inf),
#: so the integer max of the masked bits is the float amax, NaN included; on a CPU this is one
#: integer pass and a vectorized integer max, 3.7x faster than ``abs().amax()`` on bfloat16
#: (EPYC Zen 4, 1 thread, 0.10 against 0.37 ns per element)
_MAGNITUDE_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def scale_for(amax: Tensor, dtype: torch.dtype, power_of_2: bool = False) -> Tensor:
    """The multiplier that maps ``amax`` onto ``dtype``'s largest finite value.

    A non-finite ``amax`` gives 0 (inf) or NaN (NaN), which :func:`quantize` turns into NaN
    data. ``power_of_2`` rounds the scale down to a power of two.
    """
    _check_fp8(dtype)
    top = torch.finfo(dtype).max
    # torchao's rule to the bit: the quotient in float64, rounded to float32. That is the
    # correctly rounded float32 quotient on every backend: torch computes ``number / tensor``
    # as ``tensor.reciprocal() * number``, whose two float64 roundings err by ~2^-52, while a
    # quotient of float32 numbers lies at least ~2^-49 (relative) from a float32 rounding
    # midpoint. In float32 those two roundings put about 1 scale in 4 one ulp off, and
    # Triton's float32 division is approximate.
    scale = (top / amax.double().clamp(min=_TINY)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
        # top / amax may round up onto the next power of two: then halve it, so that
        # amax * scale <= top holds exactly (the product of a power of two is exact)
        scale = torch.where(amax.float() * scale > top, scale * 0.5, scale)
    return scale


def quantize(
    x: Tensor,
    dtype: torch.dtype = E4M3,
    axis: Axis = -1,
    power_of_2: bool = False,
    scale: Tensor | None = None,
) -> Float8Data:
    """``x`` as FP8 data and a float32 scale: per tensor (``axis=None``) or per slice, the
    dims in ``axis`` reduced (``-1``: one scale per row).

    ``scale`` (optional) is used instead of one computed from ``x``'s amax, for a caller that
    already has it (e.g. a scale agreed across ranks); it is then not assumed to be a power of 2.
    """
    _check_fp8(dtype)
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating tensor, received {x.dtype}.")
    if scale is None and power_of_2:  # exact, and within range by construction
        scale = scale_for(amax(x, axis), dtype, power_of_2=True)
        # bf16 and fp32 hold every such scale (fp32's exponent range): no float32 copy of x
        wide = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
        return Float8Data((wide * scale.to(wide.dtype)).to(dtype), scale, power_of_2=True)
    if scale is None:
        scale = scale_for(amax(x, axis), dtype)
    top = torch.finfo(dtype).max
    data = (x.float() * scale).clamp_(-top, top).to(dtype)
    return Float8Data(data, scale)


def dequantize(q: Float8Data, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``q`` stands for, in ``dtype``: ``data / scale`` computed in float32, or, for
    power-of-2 scales, exactly in ``dtype`` (a NaN/inf-poisoned slice stays non-finite)."""
    if not q.power_of_2:
        return (q.data.float() / q.scale).to(dtype)
    inverse = q.scale.reciprocal()  # a power of two (or inf/NaN for a poisoned slice)
    # fp16 cannot hold every such inverse (2**-30 flushes to 0): multiply in float32 there
    wide = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    if q.data.device.type == "cpu" and (q.data.dtype, wide) in _WIDEN:
        out = _widen_bits(q.data, wide).mul_(inverse.to(wide))
    else:
        out = q.data.to(wide).mul_(inverse.to(wide))
    return out.to(dtype)


def _widen_layout(src: torch.dtype, dst: torch.dtype) -> tuple[torch.dtype, int, int, float]:
    """(integer dtype, shift, mask, factor): FP8 bits shifted into ``dst``'s fields, read as
    ``dst``, are the FP8 value times ``2**(src bias - dst bias)``; ``factor`` undoes that.

    The FP8 byte is sign-extended, so the sign lands in ``dst``'s top bit and the mask clears
    the copies of it between there and the exponent. Subnormals line up too (both formats
    scale their subnormals by the same ``2**(1 - bias)``). NaN and inf codes widen to finite
    values: :func:`quantize` writes neither into a slice with a finite scale, and a poisoned
    slice stays non-finite through its scale.
    """
    s_exp, s_man = (4, 3) if src == E4M3 else (5, 2)
    d_exp, d_man, itype = {
        torch.bfloat16: (8, 7, torch.int16),
        torch.float16: (5, 10, torch.int16),
        torch.float32: (8, 23, torch.int32),
    }[dst]
    bits = 1 + d_exp + d_man
    shift = d_man - s_man
    mask = (1 << (bits - 1)) | (((1 << (s_exp + s_man)) - 1) << shift)
    if mask >= 1 << (bits - 1):  # as a signed integer of that width
        mask -= 1 << bits
    bias = lambda e: (1 << (e - 1)) - 1  # noqa: E731
    return itype, shift, mask, 2.0 ** (bias(d_exp) - bias(s_exp))


_WIDEN = {
    (src, dst): _widen_layout(src, dst)
    for src in FP8_DTYPES
    for dst in (torch.bfloat16, torch.float16, torch.float32)
}


def _widen_bits(data: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``data.to(dtype)`` for finite FP8 values, by integer ops (see :func:`_widen_layout`);
    into ``out`` (contiguous, ``dtype``, ``data``'s shape) where given."""
    itype, shift, mask, factor = _WIDEN[(data.dtype, dtype)]
    if out is None:
        bits = data.view(torch.int8).to(itype)
    else:
        bits = out.view(itype).copy_(data.view(torch.int8))  # sign-extended
    bits.bitwise_left_shift_(shift).bitwise_and_(mask)
    wide = bits.view(dtype)
    return wide if factor == 1.0 else wide.mul_(factor)


def sqnr(reference: Tensor, approx: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(|ref| / |ref - approx|)`` (inf if
    equal). The metric torchao's FP8 tests use; 25 dB is about 2 significant bits of error."""
    ref = reference.detach().double()
    err = (ref - approx.detach().double()).norm()
    if err == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / err))


_CHUNK = 1 << 18  # elements per slice of quantize_chunked: 1 MiB of float32 scratch


def _row_slices(
    shape: torch.Size, scale: Tensor | None = None
) -> Iterator[tuple[slice, Tensor | None]]:
    """Slices of about ``_CHUNK`` elements' worth of rows of a 2-D tensor of ``shape``, each
    with its part of ``scale`` (all of it unless ``scale`` has one value a row)."""
    n, step = shape[0], max(1, _CHUNK // max(shape[1], 1))
    per_row = scale is not None and scale.dim() == 2 and scale.shape[0] == n and n > 1
    for i in range(0, n, step):
        yield slice(i, i + step), (scale[i : i + step] if per_row else scale)


def quantize_chunked(
    x: Tensor,
    dtype: torch.dtype = E4M3,
    axis: int | None = -1,
    power_of_2: bool = False,
    scale: Tensor | None = None,
) -> Float8Data:
    """:func:`quantize` of a 2-D ``x`` (``axis`` None, -1 or 0) in slices of rows: the same
    scales and data (a NaN's sign bit aside).

    :func:`quantize` holds two float32 copies of ``x`` (``x.float()`` and its scaled copy) and
    an ``abs`` copy at once: 10 bytes per element of a bf16 ``x`` on top of the result, which
    in eager mode is the largest temporary of an FP8 layer. Here the amax is taken slice by
    slice (max is exact in any order, NaN included) and each slice is scaled, clamped and cast
    into the result, so the scratch is one slice. Under ``torch.compile`` use :func:`quantize`:
    the compiler fuses it into one pass with no scratch at all.
    """
    _check_fp8(dtype)
    if x.dim() != 2 or axis not in (None, -1, 0, 1):
        raise ValueError(
            f"quantize_chunked takes a 2-D tensor and axis None, -1 or 0; received a "
            f"{x.dim()}-D tensor, axis={axis}."
        )
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating tensor, received {x.dtype}.")
    slices = [x[rows] for rows, _ in _row_slices(x.shape)] or [x]
    given = scale
    if scale is None:
        if axis in (-1, 1):
            scale = torch.cat([scale_for(amax(s, -1), dtype, power_of_2) for s in slices])
        else:
            parts = [amax(s, 0 if axis == 0 else None) for s in slices]
            top_abs = parts[0]
            for p in parts[1:]:
                top_abs = torch.maximum(top_abs, p)
            scale = scale_for(top_abs.reshape(1, -1) if axis == 0 else top_abs, dtype, power_of_2)
    top = torch.finfo(dtype).max
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    exact = power_of_2 and given is None and x.dtype in (torch.bfloat16, torch.float32)
    for rows, s in _row_slices(x.shape, scale):
        if exact:  # as quantize: scaled in x's dtype, within range by construction
            data[rows].copy_(x[rows] * s.to(x.dtype))
        else:
            part = x[rows].to(torch.float32, copy=True)  # never x itself
            data[rows] = part.mul_(s).clamp_(-top, top).to(dtype)
    return Float8Data(data, scale, power_of_2=power_of_2 and given is None)


def dequantize_into(q: Float8Data, out: Tensor) -> Tensor:
    """:func:`dequantize` of a 2-D ``q`` written into ``out`` (same shape, a float dtype), in
    slices of rows on a CPU: no whole-size temporary.

    With power-of-2 scales on a CPU the FP8 bits are widened in ``out``'s own memory (see
    :func:`_widen_layout`) and scaled there; otherwise each slice is dequantized and copied.
    """
    if out.shape != q.data.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; the data has {tuple(q.data.shape)}.")
    if q.data.device.type != "cpu" or q.data.dim() != 2:
        return out.copy_(dequantize(q, out.dtype))
    # fp16 cannot hold every inverse scale (as in dequantize): bfloat16 and float32 only
    bits = q.power_of_2 and out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
    for rows, s in _row_slices(q.data.shape, q.scale):
        data, target = q.data[rows], out[rows]
        if bits:  # widened in place, then scaled by the (power-of-2) inverse
            _widen_bits(data, out.dtype, out=target).mul_(s.reciprocal().to(out.dtype))
        else:
            target.copy_(dequantize(Float8Data(data, s, q.power_of_2), out.dtype))
    return out


def quantize_2d(
    x: Tensor, dtype: torch.dtype = E4M3, axis: int | None = -1, power_of_2: bool = False
) -> Float8Data:
    """:func:`quantize` of a 2-D ``x``: on a CPU in eager mode slice by slice
    (:func:`quantize_chunked`, no float32 copy of the whole tensor), elsewhere as one
    expression. The same scales and data either way."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return quantize(x, dtype, axis, power_of_2)
    return quantize_chunked(x, dtype, axis, power_of_2)


def dequantize_2d(q: Float8Data, dtype: torch.dtype) -> Tensor:
    """:func:`dequantize` of a 2-D ``q``: on a CPU into a new tensor slice by slice
    (:func:`dequantize_into`, no whole-size temporary), elsewhere as one expression."""
    if q.data.device.type != "cpu":
        return dequantize(q, dtype)
    return dequantize_into(q, torch.empty(q.data.shape, dtype=dtype, device=q.data.device))
