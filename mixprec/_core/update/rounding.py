"""Stochastic rounding of fp32 values to bf16 or fp16: unbiased (``E[out] == x``), seeded.

bf16 by torchao's integer trick (16 random bits added below the mantissa, then truncated),
fp16 between its two neighbours. The weight updates (:func:`keyed_round_`) take their bits from
a counter-based hash of (seed, step, parameter) and each element's index in the whole
parameter, so sharded, chunked and released steps round alike and a resume needs only the step
count; :func:`stochastic_round` (public) draws from a ``torch.Generator``.
``docs/design.md``, "Lean 16-bit updates".
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "keyed_round_",
    "round_keys",
    "shard_offset",
    "stochastic_round",
    "stochastic_round_bf16_",
    "stochastic_round_to",
]

_LOW = (torch.float16, torch.bfloat16)
_BITS_PER_DRAW = 48  # random_(0, 2**48) on int64: three uniform 16-bit lanes per draw


def _random16(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``n`` uniform 16-bit integers in [0, 65536) as int32 (3 lanes of each 48-bit draw)."""
    draws = -(-n // 3)
    raw = torch.empty(draws, dtype=torch.int64, device=device).random_(
        0, 2**_BITS_PER_DRAW, generator=generator
    )
    lanes = raw.view(torch.int16).view(draws, 4)  # little-endian: lanes 0-2 uniform, lane 3 zero
    if sys.byteorder == "big":
        lanes = lanes[:, 1:]
    out = torch.empty(draws, 3, dtype=torch.int32, device=device)
    out.copy_(lanes[:, :3])
    return out.view(-1)[:n].bitwise_and_(0xFFFF)


def stochastic_round_bf16_(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """In place on contiguous fp32 ``x``: clear the 16 low bits after adding 16 random ones.

    ``x`` then holds bf16 values exactly (copying it to bf16 is lossless). The magnitude is
    rounded up with probability (dropped bits) / 2**16, so ``E[result] = x``; signs and
    infinities are preserved (the sign bit is never reached by the carry for finite values).
    """
    bits = x.view(torch.int32)
    bits.add_(_random16(x.numel(), generator, x.device)).bitwise_and_(-65536)
    return x


def stochastic_round_to(
    x: Tensor, dtype: torch.dtype, generator: torch.Generator | None, u: Tensor | None = None
) -> Tensor:
    """Stochastic rounding of fp32 ``x`` to ``dtype`` via its two neighbours (any float dtype);
    ``u``: the uniform [0, 1) draws to use (default: drawn from ``generator``)."""
    near = x.to(dtype)
    err = x - near.float()
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)
    gap = other.float() - near.float()
    if u is None:
        u = torch.rand(x.shape, generator=generator, device=x.device)
    # |err| <= gap / 2, so take the far neighbour with probability |err| / gap: E[out] = x.
    take = (err != 0) & torch.isfinite(gap) & (u * gap.abs() < err.abs())
    return torch.where(take, other, near)


_M64 = 2**64 - 1
_M1, _M2 = 0x7FEB352D, 0x846CA68B - 2**32  # lowbias32's multipliers (as signed int32)


def _int32(v: int) -> int:
    """``v`` mod 2**32 as a signed int32 scalar (torch refuses out-of-range int scalars)."""
    return ((v + 2**31) & 0xFFFFFFFF) - 2**31


def _splitmix64(v: int) -> int:
    v = (v + 0x9E3779B97F4A7C15) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return v ^ (v >> 31)


def round_keys(seed: int, step: int, ordinal: int) -> tuple[int, int]:
    """The two 32-bit keys of parameter ``ordinal``'s rounding at ``step``: the first is added
    to each element's global index, the second (the same for every parameter of a step) is
    xor-ed between the hash rounds."""
    base = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return _splitmix64(base ^ _splitmix64(ordinal + 1)) & 0xFFFFFFFF, base & 0xFFFFFFFF


def shard_offset(p: Tensor) -> int:
    """Where the local tensor of ``p`` starts in the whole parameter, in elements: 0 for a plain
    tensor (see :func:`_dtensor_offset` for a DTensor)."""
    placements = getattr(p, "placements", None)
    return 0 if placements is None else _dtensor_offset(p, placements)


def _dtensor_offset(p: Tensor, placements: Any) -> int:
    """The first row's offset of a DTensor sharded along dim 0 (FSDP2), whose local rows are
    one contiguous run of the whole tensor's elements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not isinstance(pl, Replicate) and pl != Shard(0) for pl in placements):
        raise ValueError(
            f"Stochastic rounding of a DTensor parameter needs it sharded along dim 0 "
            f"(FSDP2's default) or replicated; received placements {tuple(placements)}. "
            "Shard parameters along dim 0 (fully_shard without shard_placement_fn)."
        )
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    row = 1
    for size in p.shape[1:]:
        row *= size
    return int(offset[0]) * row if offset else 0


def _shift_xor_(h: Tensor, tmp: Tensor, k: int) -> None:
    """``h ^= h >>> k`` (logical shift) on int32, through ``tmp``."""
    torch.bitwise_right_shift(h, k, out=tmp)
    h.bitwise_xor_(tmp.bitwise_and_((1 << (32 - k)) - 1))


def keyed_bits_(
    h: Tensor, tmp: Tensor, segments: list[tuple[int, int, int]], mix: int, bits: int
) -> Tensor:
    """Fill int32 ``h`` with ``bits`` (<= 24) uniform random bits per element, in [0, 2**bits).

    ``segments``: ``(length, global offset, key)`` per parameter, in ``h``'s order; element
    ``j`` of a segment gets ``hash(global offset + j + key, mix)``. ``tmp``: int32 scratch of
    ``h``'s size. Returns ``h``.
    """
    torch.arange(h.numel(), out=h)
    parts, starts, adds = [], 0, []
    for length, offset, key in segments:
        parts.append(h[starts : starts + length])
        adds.append(_int32(offset + key - starts))
        starts += length
    torch._foreach_add_(parts, adds)
    _shift_xor_(h, tmp, 16)
    h.mul_(_M1)
    _shift_xor_(h, tmp, 15)
    h.bitwise_xor_(_int32(mix))
    h.mul_(_M2)
    # the top bits of the last product are its best mixed: no final xorshift needed
    torch.bitwise_right_shift(h, 32 - bits, out=tmp)
    return h.copy_(tmp.bitwise_and_((1 << bits) - 1))


def keyed_round_(
    flat: Tensor,
    dtype: torch.dtype,
    segments: list[tuple[int, int, int]],
    mix: int,
    scratch: tuple[Tensor, Tensor],
) -> Tensor:
    """Stochastic rounding of contiguous fp32 ``flat`` to ``dtype`` with counter-based bits
    (see the module docstring and :func:`keyed_bits_`). ``scratch``: two 4-byte buffers of at
    least ``flat``'s size (any dtype; viewed as int32). bf16: rounded in place (``flat`` then
    holds bf16 values exactly) and returned; fp16: returned as a new ``dtype`` tensor."""
    n = flat.numel()
    h, tmp = (b.view(torch.int32)[:n] for b in scratch)
    if dtype == torch.bfloat16:
        keyed_bits_(h, tmp, segments, mix, 16)
        bits = flat.view(torch.int32)
        bits.add_(h).bitwise_and_(-65536)
        return flat
    u = tmp.view(torch.float32)
    torch.mul(keyed_bits_(h, tmp, segments, mix, 24), 2.0**-24, out=u)  # exact in fp32
    return stochastic_round_to(flat, dtype, None, u)


def stochastic_round(
    x: Tensor, dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None
) -> Tensor:
    """Round ``x`` (fp32) to ``dtype`` stochastically: each value goes to one of its two
    neighbours in ``dtype`` with probability proportional to closeness, so ``E[out] == x``.

    Args:
        x: a float32 tensor.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        generator: a ``torch.Generator`` on ``x.device`` for reproducible draws.
    """
    if dtype not in _LOW:
        raise ValueError(
            f"stochastic_round rounds to torch.bfloat16 or torch.float16, received {dtype}."
        )
    if x.dtype != torch.float32:
        raise TypeError(
            f"stochastic_round expects a float32 tensor, received {x.dtype}; call .float() first."
        )
    if dtype == torch.bfloat16:
        return stochastic_round_bf16_(
            x.detach().clone(memory_format=torch.contiguous_format), generator
        ).to(dtype)
    return stochastic_round_to(x, dtype, generator)
