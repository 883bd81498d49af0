"""Will a Linear of shape (M, K, N) train faster in FP8 than in bf16 on a given GPU?

Design: a roofline per GEMM, torchao's model (``float8_roofline.py``): each GEMM takes
``max(flops / achievable peak, bytes / achievable bandwidth)``, and FP8 adds the casts, which
only move memory. A Linear's training step is three GEMMs -- ``(M, K, N)`` for the output,
``(M, N, K)`` for the input gradient, ``(N, M, K)`` for the weight gradient -- so

    bf16 = sum of the three at the bf16 peak, 2-byte operands
    fp8  = sum of the three at the FP8 peak, 1-byte operands
           + cast traffic: per element of x, w and dy, read twice (amax, then cast) in 16 bits
             and written once in 8, plus the transposed copies CUDA's layouts need:
             7 bytes tensorwise; 10 rowwise (a per-row and a per-column copy of each)

and FP8 is worth it when ``bf16 / fp8 >= MIN_SPEEDUP``. The casts are counted as fused kernels
(what ``torch.compile`` makes of them); eager FP8 launches more of them and is slower.

Calibration: the achievable fractions (78 % of the bf16 peak, 92 % of the bandwidth) are
torchao's; the FP8 fractions (70 % tensorwise, 60 % rowwise, whose CUTLASS kernel is slower)
were chosen so the model reproduces torchao's published H100 measurements within about 10 %:
tensorwise 0.79x at (1024, 2048, 1024) (measured 0.80x), 1.30x at 4096^3 (1.24x), 1.51x at
8192^3 (1.43x); rowwise 1.23x at 8192^3 (1.20x), 1.05x at (4096, 4096, 8192) (1.01x).

Peaks are the vendors' dense tensor-core figures (no sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "MIN_SPEEDUP", "gpu_for_name", "predicted_speedup"]

MIN_SPEEDUP = 1.05  # below this the prediction's error could turn a gain into a loss
_GEMM_EFFICIENCY = {"bf16": 0.78, "tensorwise": 0.70, "rowwise": 0.60}
_BANDWIDTH_EFFICIENCY = 0.92
_CAST_BYTES = {"tensorwise": 7, "rowwise": 10}  # per element of x, w and dy


@dataclass(frozen=True)
class GPU:
    """Dense peaks of one GPU: bf16 and FP8 tensor-core FLOP/s, memory bandwidth in B/s."""

    name: str
    bf16_flops: float
    fp8_flops: float
    bandwidth: float


GPUS: dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM", 989e12, 1979e12, 3.35e12),
    "h200": GPU("NVIDIA H200 SXM", 989e12, 1979e12, 4.8e12),
    "b200": GPU("NVIDIA B200", 2250e12, 4500e12, 8.0e12),
    "l40s": GPU("NVIDIA L40S", 362e12, 733e12, 0.864e12),
}

# substrings of torch.cuda.get_device_name(), most specific first
_NAME_KEYS = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("B200", "b200"))
_NAME_KEYS += (("L40S", "l40s"), ("L40", "l40s"))


def gpu_for_name(device_name: str) -> str | None:
    """The :data:`GPUS` key for a CUDA device name (``torch.cuda.get_device_name()``)."""
    for needle, key in _NAME_KEYS:
        if needle in device_name:
            return key
    return None


def _gemm_seconds(m: int, k: int, n: int, flops: float, eff: float, gpu: GPU, width: int) -> float:
    compute = 2.0 * m * k * n / (flops * eff)
    memory = (width * (m * k + k * n) + 2 * m * n) / (gpu.bandwidth * _BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


def step_seconds(m: int, k: int, n: int, gpu: GPU, recipe: str | None) -> float:
    """Predicted seconds of one Linear's three GEMMs (and FP8 casts) in a training step;
    ``recipe`` None is bf16."""
    gemms = ((m, k, n), (m, n, k), (n, m, k))
    if recipe is None:
        eff = _GEMM_EFFICIENCY["bf16"]
        return sum(_gemm_seconds(*g, gpu.bf16_flops, eff, gpu, 2) for g in gemms)
    eff = _GEMM_EFFICIENCY[recipe]
    total = sum(_gemm_seconds(*g, gpu.fp8_flops, eff, gpu, 1) for g in gemms)
    cast_bytes = _CAST_BYTES[recipe] * (m * k + n * k + m * n)
    return total + cast_bytes / (gpu.bandwidth * _BANDWIDTH_EFFICIENCY)


def predicted_speedup(m: int, k: int, n: int, gpu: str | GPU, recipe: str) -> float:
    """bf16 time / FP8 time for a Linear with ``m`` tokens, ``k`` in and ``n`` out features."""
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    if min(m, k, n) <= 0:
        return 0.0
    return step_seconds(m, k, n, spec, None) / step_seconds(m, k, n, spec, recipe)
