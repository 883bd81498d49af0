"""One FP8 GEMM through ``torch._scaled_mm``, held to CUDA's rules on every device.

Design: torch's CPU ``_scaled_mm`` accepts what its CUDA kernels reject (any K and N, a
row-major second operand, e5m2 x e5m2), so code that passes on a CPU could fail on an H100.
Every call here is checked against the CUDA rules first (``_check_scaled_mm_sizes`` and
``ScaledBlas.cpp`` in torch), whatever the device, so the CPU tests catch what CUDA would
refuse:

* ``a`` (M, K) row-major, ``b`` (K, N) column-major;
* K and N multiples of 16 (M is free);
* not both operands e5m2;
* float32 scales, both per tensor (one element) or both per row (``(M, 1)`` and ``(1, N)``);
* per-row scaling writes bfloat16 (CUDA has no float32 output for it);
* a bias only with a 16-bit output of the bias's dtype.

:func:`layer_shape_ok` is the same rule for a whole ``nn.Linear``: in and out features
multiples of 16, so all three of its GEMMs can run (the tokens dimension of the weight-gradient
GEMM is padded to a multiple of 16 by the caller).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mixprec.fp8.quantization import E5M2, FP8_DTYPES

__all__ = ["ALIGN", "check_gemm", "layer_shape_ok", "scaled_mm"]

ALIGN = 16  # CUDA's FP8 GEMMs need K and N in multiples of 16
CPU_CHUNK = 1 << 18  # elements of a's (and the output's) rows per CPU _scaled_mm call
_LOW = (torch.bfloat16, torch.float16)


def layer_shape_ok(in_features: int, out_features: int) -> str | None:
    """None if a Linear of this shape can run its three GEMMs in FP8 on CUDA, else why not."""
    bad = [
        f"{name}={n}"
        for name, n in (("in_features", in_features), ("out_features", out_features))
        if n % ALIGN
    ]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {ALIGN} (CUDA's FP8 GEMM rule)"
    return None


def check_gemm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype):
    """Raise ``ValueError`` where CUDA's ``_scaled_mm`` would refuse these operands."""
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 GEMM operands must be FP8, received {a.dtype} and {b.dtype}.")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("CUDA's FP8 GEMM does not multiply two float8_e5m2 matrices.")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"FP8 GEMM shapes {tuple(a.shape)} x {tuple(b.shape)} do not multiply.")
    k, n = b.shape
    if k % ALIGN or n % ALIGN:
        raise ValueError(
            f"FP8 GEMM (M, K, N) = ({a.shape[0]}, {k}, {n}): CUDA needs K and N in multiples "
            f"of {ALIGN}."
        )
    if a.shape[0] > 1 and a.stride(1) != 1:
        raise ValueError("FP8 GEMM: the first operand must be row-major (CUDA's layout rule).")
    if k > 1 and b.stride(0) != 1:
        raise ValueError("FP8 GEMM: the second operand must be column-major (CUDA's layout rule).")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"FP8 GEMM scales must be float32, received {scale_a.dtype}.")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (a.shape[0], 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        raise ValueError(
            f"FP8 GEMM scales {tuple(scale_a.shape)} and {tuple(scale_b.shape)}: both per "
            f"tensor, or ({a.shape[0]}, 1) and (1, {n}) per row."
        )
    if rowwise and not tensorwise and out_dtype != torch.bfloat16:
        raise ValueError(f"Per-row FP8 GEMMs write bfloat16 on CUDA, not {out_dtype}.")


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: Tensor | None = None,
) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype``; scales are dequantization factors
    (the inverse of :func:`mixprec.fp8.quantization.scale_for`'s). Checked by :func:`check_gemm`.

    On a CPU the rows of ``a`` go through ``_scaled_mm`` in slices (each output row is the same
    computation either way; eager and compiled code slice alike): torch's CPU kernel holds
    float32 copies of both operands and a float32 output, the largest temporaries of an
    emulated FP8 layer."""
    check_gemm(a, b, scale_a, scale_b, out_dtype)
    if bias is not None and (out_dtype not in _LOW or bias.dtype != out_dtype):
        raise ValueError(
            f"FP8 GEMM bias: CUDA adds a bias only to a 16-bit output of its dtype; received a "
            f"{bias.dtype} bias for a {out_dtype} output."
        )
    m = a.shape[0]
    rows = max(1, CPU_CHUNK // max(a.shape[1], b.shape[1], 1))
    if a.device.type != "cpu" or m <= rows:
        return torch._scaled_mm(
            a,
            b,
            scale_a=scale_a,
            scale_b=scale_b,
            bias=bias,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    # torch's CPU kernel emulates the GEMM in float32 with two float32 copies of each operand
    # (8 bytes per element of a, at once): on a CPU, slices of a's rows keep that scratch small
    out = torch.empty(m, b.shape[1], dtype=out_dtype, device=a.device)
    rowwise = scale_a.numel() > 1
    for i in range(0, m, rows):
        out[i : i + rows] = torch._scaled_mm(
            a[i : i + rows],
            b,
            scale_a=scale_a[i : i + rows] if rowwise else scale_a,
            scale_b=scale_b,
            bias=bias,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    return out
