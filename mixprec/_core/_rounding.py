"""Stochastic rounding of fp32 values to bf16 or fp16: unbiased (``E[out] == x``), seeded.

Design: the rounding that ``update="stochastic"`` writes 16-bit weights back with
(:mod:`mixprec._core.lean`), also public as :func:`mixprec.numerics.stochastic_round`.

* **bf16: the integer trick** of torchao's ``bf16_stochastic_round``: add 16 random bits below
  the bf16 mantissa of the fp32 bit pattern, then truncate. One integer pass, in place, and
  the result is exactly a bf16 value, so the copy to bf16 is lossless.
* **fp16 (any dtype): the two neighbours.** Pick the far neighbour with probability
  ``|error| / gap`` (subnormals included), so the expectation is ``x``.
* **Random bits are drawn 48 at a time** (``random_(0, 2**48)`` on int64 gives three uniform
  16-bit lanes): a third of the draws of one per element. The bits depend only on the
  generator's state and the number of elements, so a restored generator rounds as before.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = ["stochastic_round", "stochastic_round_bf16_", "stochastic_round_to"]

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


def stochastic_round_to(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None) -> Tensor:
    """Stochastic rounding of fp32 ``x`` to ``dtype`` via its two neighbours (any float dtype)."""
    near = x.to(dtype)
    err = x - near.float()
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)
    gap = other.float() - near.float()
    u = torch.rand(x.shape, generator=generator, device=x.device)
    # |err| <= gap / 2, so take the far neighbour with probability |err| / gap: E[out] = x.
    take = (err != 0) & torch.isfinite(gap) & (u * gap.abs() < err.abs())
    return torch.where(take, other, near)


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
