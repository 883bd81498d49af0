"""Per layer: FP8 or 16-bit, and why (the speed side, a roofline per GPU, and the numbers).

Design: the choice has a speed side and a numbers side, and a layer runs in FP8 only when both
say yes (``layers="auto"``):

* **Speed.** The layer's shape must pass CUDA's FP8 GEMM rule (in and out features multiples
  of 16) on every device, and the roofline below must predict at least :data:`MIN_SPEEDUP` for
  its (M, K, N) on the GPU the model trains on -- an H100 when the model is on a CPU, where FP8
  is emulated, so a CPU run chooses what a GPU run would.
* **Numbers.** On a real batch, the input and the weight are cast as the recipe casts them
  and measured: amax, the fraction of values that leave the format at that scale (non-zero
  values that flush to zero; non-finite values), and the SQNR of the cast. A cast below
  :data:`MIN_CAST_SQNR` dB or flushing more than :data:`MAX_UNDERFLOW` of its values keeps the
  layer in 16-bit. (SQNR is ``20 log10(|x| / |x - cast(x)|)``; e4m3 of Gaussian data gives
  about 31 dB, so 25 dB allows for moderate outliers and no more.)

The embedding and the output head are never candidates of ``"auto"`` or ``"all"``: they are
not Linears of a block, and the head's logits feed the loss directly.

Every choice carries a sentence (:attr:`FP8Choice.reason`) that says which rule decided it and
with which numbers.

The roofline (will a Linear of shape (M, K, N) train faster in FP8 than in bf16?) is torchao's
model (``float8_roofline.py``): each GEMM takes ``max(flops / achievable peak, bytes /
achievable bandwidth)``, and FP8 adds the casts, which only move memory. A Linear's training
step is three GEMMs -- ``(M, K, N)`` for the output, ``(M, N, K)`` for the input gradient,
``(N, M, K)`` for the weight gradient -- so

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
8192^3 (1.43x); rowwise 1.23x at 8192^3 (1.20x), 1.05x at (4096, 4096, 8192) (1.01x). Peaks
are the vendors' dense tensor-core figures (no sparsity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mixprec.fp8.config import Scaling
from mixprec.fp8.gemm import layer_shape_ok
from mixprec.fp8.quantization import E4M3, dequantize, quantize, scale_for, sqnr

__all__ = [
    "GPU",
    "GPUS",
    "MAX_UNDERFLOW",
    "MIN_CAST_SQNR",
    "MIN_SPEEDUP",
    "CastStats",
    "FP8Choice",
    "FP8Plan",
    "cast_stats",
    "decide",
    "gpu_for_name",
    "judge_numbers",
    "judge_speed",
    "predicted_speedup",
]

# -- speed: the roofline -----------------------------------------------------------------------

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


# -- numbers: what survives the cast -----------------------------------------------------------

MIN_CAST_SQNR = 25.0
MAX_UNDERFLOW = 0.01


@dataclass(frozen=True)
class CastStats:
    """How one tensor survives its FP8 cast.

    Attributes:
        dtype: the FP8 format, e.g. ``"float8_e4m3fn"``.
        amax: largest magnitude (inf/NaN if the tensor holds one).
        underflow: fraction of the non-zero values that the cast turns into zero.
        overflow: fraction of the values that are non-finite or beyond the format's range at
            the scale used (the cast returns NaN for their slice instead of saturating).
        sqnr: SQNR of the cast in dB (``-inf`` where it produced NaN).
    """

    dtype: str
    amax: float
    underflow: float
    overflow: float
    sqnr: float

    def __str__(self) -> str:
        return (
            f"{self.dtype.replace('float8_', '')} amax {self.amax:.3g}, SQNR {self.sqnr:.1f} dB, "
            f"underflow {self.underflow:.2%}, overflow {self.overflow:.2%}"
        )


_SAMPLE = 1 << 20  # elements measured per tensor; the scale always comes from all of it


@torch.no_grad()
def cast_stats(x: Tensor, dtype: torch.dtype, recipe: Scaling) -> CastStats:
    """Cast ``x`` as ``recipe`` casts a GEMM operand (one scale, or one per row of its last
    dim) and measure what survives. The amax and a per-tensor scale come from all of ``x``;
    the error figures from at most about a million of its values (whole rows, evenly spaced),
    so a 67M-element weight costs two passes, not a dozen."""
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    lo, hi = torch.aminmax(x2)
    amax = torch.maximum(lo.abs(), hi.abs()).float()
    step = max(1, -(-x2.numel() // _SAMPLE))
    if recipe.rowwise:
        sample = x2[:: max(1, -(-x2.shape[0] // max(1, _SAMPLE // x2.shape[1])))].float()
        q = quantize(sample, dtype, -1, recipe.power_of_2)
    else:
        sample = x2.reshape(-1)[::step].float()
        q = quantize(sample, dtype, None, recipe.power_of_2, scale=scale_for(amax, dtype))
    back = dequantize(q)
    finite = torch.isfinite(sample)
    # beyond the format at this scale (a hair of rounding above the largest value is not)
    beyond = (sample * q.scale).abs() > torch.finfo(dtype).max * (1 + 2**-20)
    nonzero = (sample != 0) & finite
    flushed = nonzero & (back == 0)
    ok = bool(torch.isfinite(back).all())
    return CastStats(
        dtype=str(dtype).replace("torch.", ""),
        amax=float(amax),
        underflow=float(flushed.sum()) / max(int(nonzero.sum()), 1),
        overflow=float(((~finite) | beyond).sum()) / max(sample.numel(), 1),
        sqnr=sqnr(sample, back) if ok else -math.inf,
    )


@dataclass(frozen=True)
class FP8Choice:
    """One layer's choice.

    Attributes:
        name: the module's path in the model.
        fp8: True if its GEMMs run in FP8.
        reason: which rule decided, with its numbers.
        shape: ``(M, K, N)`` the speed side was judged at (None where it was not judged).
        speedup: predicted FP8 speedup of its three GEMMs on ``target`` (None if not judged).
        target: the GPU the speed side was judged for.
        input, weight, grad: :class:`CastStats` of the operands measured (None if not).
        pending: True while a ``"auto"`` layer waits for its first batch.
    """

    name: str
    fp8: bool
    reason: str
    shape: tuple[int, int, int] | None = None
    speedup: float | None = None
    target: str | None = None
    input: CastStats | None = None
    weight: CastStats | None = None
    grad: CastStats | None = None
    pending: bool = False


def judge_speed(m: int, k: int, n: int, recipe: Scaling, target: str) -> tuple[bool, str, float]:
    """(faster, sentence, predicted speedup) for a Linear with ``m`` tokens on ``target``."""
    why = layer_shape_ok(k, n)
    if why is not None:
        return False, why, 0.0
    speedup = predicted_speedup(m, k, n, target, recipe.name)
    gpu = GPUS[target].name
    at = f"(M, K, N) = ({m}, {k}, {n})"
    if speedup < MIN_SPEEDUP:
        return False, f"predicted {speedup:.2f}x on {gpu} at {at}, below {MIN_SPEEDUP}x", speedup
    return True, f"predicted {speedup:.2f}x on {gpu} at {at}", speedup


def judge_numbers(stats: dict[str, CastStats | None]) -> tuple[bool, str]:
    """(survive, sentence) from the measured casts, e.g. ``{"input": ..., "weight": ...}``."""
    for what, s in stats.items():
        if s is None:
            continue
        if s.overflow > 0:
            return False, (
                f"{what}: {s.overflow:.2%} of its values outside the FP8 range (inf/NaN, or "
                f"beyond the largest value at the scale; amax {s.amax:.3g})"
            )
        if s.sqnr < MIN_CAST_SQNR:
            return False, f"{what} cast SQNR {s.sqnr:.1f} dB < {MIN_CAST_SQNR:g} dB ({s})"
        if s.underflow > MAX_UNDERFLOW:
            return False, (
                f"{what} cast flushes {s.underflow:.2%} of its values to zero "
                f"(> {MAX_UNDERFLOW:.0%}; amax {s.amax:.3g})"
            )
    shown = ", ".join(f"{w} {s.sqnr:.1f} dB" for w, s in stats.items() if s is not None)
    return True, f"casts survive ({shown})"


def operand_stats(x: Tensor, weight: Tensor, recipe: Scaling) -> dict[str, CastStats]:
    """The forward operands of a Linear cast as ``recipe`` casts them."""
    k = weight.shape[1]
    return {
        "input": cast_stats(x.reshape(-1, k), E4M3, recipe),
        "weight": cast_stats(weight, E4M3, recipe),
    }


def decide(
    name: str,
    recipe: Scaling,
    x: Tensor,
    weight: Tensor,
    target: str,
    tokens: int | None = None,
    grad: Tensor | None = None,
) -> FP8Choice:
    """The ``"auto"`` choice for one Linear from a real input ``x`` (and optionally the
    gradient of its output): speed at ``tokens`` (default: x's) tokens on ``target``, then the
    numbers of the casts."""
    n, k = weight.shape
    m = tokens or x.numel() // k
    fast, why, speedup = judge_speed(m, k, n, recipe, target)
    stats: dict[str, CastStats | None] = dict(operand_stats(x, weight, recipe))
    stats["grad"] = (
        None if grad is None else cast_stats(grad.reshape(-1, n), recipe.grad_dtype, recipe)
    )
    info = dict(shape=(m, k, n), speedup=speedup, target=target, **stats)
    if not fast:
        return FP8Choice(name, False, why, **info)
    ok, numbers = judge_numbers(stats)
    return FP8Choice(name, ok, f"{why}; {numbers}" if ok else f"{numbers}; {why}", **info)


class FP8Plan:
    """Each Linear's :class:`FP8Choice`, by module path: what :func:`mixprec.fp8.fp8_plan` returns.

    A plan is also a layer predicate: ``FP8Config(layers=plan)`` applies its choices as they
    are (with their reasons), e.g. to resume a run with the layers it chose.
    """

    def __init__(self, choices: dict[str, FP8Choice], recipe: str, target: str | None) -> None:
        self._choices = dict(choices)
        self.recipe = recipe
        self.target = target

    def __getitem__(self, name: str) -> FP8Choice:
        return self._choices[name]

    def get(self, name: str, default: FP8Choice | None = None) -> FP8Choice | None:
        return self._choices.get(name, default)

    def __iter__(self):
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)

    def __contains__(self, name: object) -> bool:
        return name in self._choices

    def items(self):
        return self._choices.items()

    def values(self):
        return self._choices.values()

    def __call__(self, name: str, module: object = None) -> bool:
        choice = self._choices.get(name)
        return choice is not None and choice.fp8

    @property
    def chosen(self) -> list[str]:
        """The paths of the layers that run in FP8."""
        return [n for n, c in self._choices.items() if c.fp8]

    def __repr__(self) -> str:
        return f"FP8Plan({len(self.chosen)} of {len(self)} Linear layers in FP8, {self.recipe})"

    def __str__(self) -> str:
        where = f", speed judged for {self.target}" if self.target else ""
        lines = [f"FP8 plan ({self.recipe}{where}): {len(self.chosen)} of {len(self)} in FP8"]
        width = max((len(n) for n in self._choices), default=5)
        for name, c in self._choices.items():
            mark = "fp8" if c.fp8 else "16-bit"
            lines.append(f"  {name:<{width}}  {mark:<6}  {c.reason}")
        return "\n".join(lines)
