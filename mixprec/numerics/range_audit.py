"""Range audit: would these activations and gradients fit in fp16 / bf16 at this loss scale?

``with mixprec.numerics.range_audit(model) as audit: ...a few fp32 or bf16 steps...`` then
``audit.summary()``, ``audit.recommended_loss_scale()``, ``audit.plot("grads.png")``.

Design (Micikevicius et al. 2017, Fig. 3 and §3.2, and Transformer Engine's underflow/overflow
statistics; ``docs/design.md``, "Numerics tools"):

* Forward hooks on the chosen modules see their outputs (activations); a tensor hook on each
  output sees the gradient arriving at it (the *activation gradient* of the paper's figure).
  The hooks only read: they return None and copy to fp32 for the statistics.
* For each module and each of ``activation`` / ``gradient`` the audit keeps a histogram of
  ``floor(log2|x|)`` (exact, from ``torch.frexp``; zeros and non-finite values counted apart)
  and, for fp16 and bf16, exact counts of nonzero values that would **underflow** to zero
  (``|x| < smallest subnormal``), land in the **subnormal** range (``|x| < smallest normal``,
  lost precision) or **overflow** (``|x| > max``), computed on the fly from ``torch.finfo``.
  Fractions are of the nonzero finite values (a zero is a zero in every format).
* Gradients are judged at ``loss_scale`` (the current scale by default): what a backward of
  ``loss * loss_scale`` would hold. Run the audit on an fp32 (or bf16) step, where nothing has
  underflowed yet, to see what fp16 would do. If the watched backward is itself scaled (an
  ``optimizer`` with a loss scaler is given), observed gradients are divided by that scale first.
* **FP8 layers** (Linears running in FP8 under ``fp8=``) are also judged at the scales their
  recipe uses: amax, the fraction of values outside the FP8 range at that scale (non-zero
  values flushed to zero; inf/NaN or values beyond the largest) and the SQNR of the cast, for
  the input, the weight and the output gradient, plus the SQNR of the layer's FP8 output
  against the same layer computed in 16 bits (one extra 16-bit GEMM per call, in the hook).
  Each figure keeps its worst value over the audited calls.
* The recommended fp16 loss scale is the largest power of two that keeps the largest gradient
  seen at least one binade (2x) below fp16's max, clamped to [1, 2**24]: the paper's recipe
  ("as large as possible without overflow") with headroom for the next batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.fp8.choice import CastStats, cast_stats
from mixprec.fp8.layers import layers_of
from mixprec.fp8.quantization import E4M3, sqnr
from mixprec.numerics.nonfinite_ops import iter_tensors

__all__ = ["FP8Stats", "RangeAudit", "RangeStats", "range_audit"]

EXP_MIN, EXP_MAX = -160, 140  # floor(log2|x|) bins; fp32 subnormals reach -149, max is 127
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_KINDS = ("activation", "gradient")


@dataclass
class RangeStats:
    """Accumulated statistics of one (module, kind): histogram and fp16/bf16 range counts."""

    hist: Tensor = field(default_factory=lambda: torch.zeros(EXP_MAX - EXP_MIN, dtype=torch.int64))
    zeros: int = 0
    nonfinite: int = 0
    nonzero: int = 0
    absmax: float = 0.0
    absmin: float = math.inf  # smallest nonzero |x|
    underflow: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DTYPES, 0))
    subnormal: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DTYPES, 0))
    overflow: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DTYPES, 0))

    @torch.no_grad()
    def add(self, t: Tensor, divide: float = 1.0, scale: float = 1.0) -> None:
        """Add the values of ``t / divide`` (histogram) judged at ``* scale`` (range counts)."""
        a = t.detach().flatten().float().abs()
        if divide != 1.0:
            a = a / divide
        n = a.numel()
        hist, valid = _log2_hist(a)
        nonzero = int(hist.sum())
        zeros = int((a == 0).sum())
        self.nonfinite += n - nonzero - zeros
        self.zeros += zeros
        if not nonzero:
            return
        self.nonzero += nonzero
        self.hist += hist
        self.absmax = max(self.absmax, float(torch.where(valid, a, 0).max()))
        self.absmin = min(self.absmin, float(torch.where(valid, a, math.inf).min()))
        # subnormal and normal limits are powers of two: read them off the histogram of the
        # scaled values (exact); the max is not, so overflow is one comparison per dtype
        s = a * scale if scale != 1.0 else a
        shist = hist if scale == 1.0 else _log2_hist(s)[0]
        for name, dt in _DTYPES.items():
            fi = torch.finfo(dt)
            sub = round(math.log2(fi.smallest_normal * fi.eps)) - EXP_MIN  # bin of 2**-24 etc.
            normal = round(math.log2(fi.smallest_normal)) - EXP_MIN
            self.underflow[name] += int(shist[:sub].sum())
            self.subnormal[name] += int(shist[sub:normal].sum())
            self.overflow[name] += int(((s > fi.max) & valid).sum())

    def fractions(self, dtype: str = "fp16") -> dict[str, float]:
        """Fractions of nonzero finite values that underflow / are subnormal / overflow."""
        n = max(self.nonzero, 1)
        return {
            "underflow": self.underflow[dtype] / n,
            "subnormal": self.subnormal[dtype] / n,
            "overflow": self.overflow[dtype] / n,
        }

    def as_dict(self) -> dict[str, Any]:
        lo = int(torch.nonzero(self.hist).min()) if self.nonzero else 0
        hi = int(torch.nonzero(self.hist).max()) + 1 if self.nonzero else 0
        return {
            "zeros": self.zeros,
            "nonzero": self.nonzero,
            "nonfinite": self.nonfinite,
            "absmax": self.absmax,
            "absmin": self.absmin if self.nonzero else None,
            "log2_hist": {
                str(EXP_MIN + i): int(self.hist[i]) for i in range(lo, hi) if self.hist[i]
            },
            **{d: self.fractions(d) for d in _DTYPES},
        }


def _worse(a: CastStats | None, b: CastStats) -> CastStats:
    """Each figure at its worst of the two."""
    if a is None:
        return b
    return CastStats(
        a.dtype,
        max(a.amax, b.amax),
        max(a.underflow, b.underflow),
        max(a.overflow, b.overflow),
        min(a.sqnr, b.sqnr),
    )


@dataclass
class FP8Stats:
    """What one FP8 layer's casts did over the audited calls (each figure at its worst)."""

    recipe: str
    calls: int = 0
    input: CastStats | None = None
    weight: CastStats | None = None
    grad: CastStats | None = None
    output_sqnr: float = math.inf  # the FP8 output against the layer computed in 16 bits

    @torch.no_grad()
    def add_forward(self, module: nn.Linear, recipe: Any, x: Tensor, y: Tensor) -> None:
        self.calls += 1
        k = module.in_features
        self.input = _worse(self.input, cast_stats(x.reshape(-1, k), E4M3, recipe))
        self.weight = _worse(self.weight, cast_stats(module.weight, E4M3, recipe))
        dt = y.dtype
        bias = None if module.bias is None else module.bias.to(dt)
        with torch.autocast(y.device.type, enabled=False):
            ref = F.linear(x.to(dt), module.weight.to(dt), bias)
        self.output_sqnr = min(self.output_sqnr, sqnr(ref, y))

    def add_grad(self, recipe: Any, g: Tensor) -> None:
        self.grad = _worse(
            self.grad, cast_stats(g.reshape(-1, g.shape[-1]), recipe.grad_dtype, recipe)
        )

    def as_dict(self) -> dict[str, Any]:
        plain = lambda c: None if c is None else vars(c)  # noqa: E731
        return {
            "recipe": self.recipe,
            "calls": self.calls,
            "input": plain(self.input),
            "weight": plain(self.weight),
            "grad": plain(self.grad),
            "output_sqnr_vs_16bit": self.output_sqnr,
        }


def _log2_hist(a: Tensor) -> tuple[Tensor, Tensor]:
    """Histogram of ``floor(log2 a)`` over the finite nonzero entries of ``a >= 0``; the mask."""
    valid = torch.isfinite(a) & (a > 0)
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
    bins = EXP_MAX - EXP_MIN
    idx = (e.long() - 1 - EXP_MIN).clamp_(0, bins - 1).masked_fill_(~valid, bins)
    return torch.bincount(idx, minlength=bins + 1)[:bins].cpu(), valid


class RangeAudit:
    """Collects :class:`RangeStats` for the chosen modules' activations and gradients.

    Args:
        model: the model.
        modules: module paths (or modules) to watch; default every module that owns
            parameters directly.
        loss_scale: the scale gradients are judged at; default the optimizer's current scale,
            else 1.0 (no scaling).
        optimizer: a :class:`mixprec._core.optimizer.MixedPrecisionOptimizer` whose scaled backward
        is watched:
            observed gradients are divided by its scale for the histograms.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Iterable[str | nn.Module] | None = None,
        *,
        loss_scale: float | None = None,
        optimizer: Any = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"range_audit expects an nn.Module, received {type(model).__name__}.")
        if loss_scale is not None and not (
            isinstance(loss_scale, (int, float)) and loss_scale > 0 and math.isfinite(loss_scale)
        ):
            raise ValueError(
                f"loss_scale must be a positive finite number, received {loss_scale!r}."
            )
        self.model = model
        self.optimizer = optimizer
        self._loss_scale = loss_scale
        paths = {id(m): n for n, m in model.named_modules()}
        if modules is None:
            chosen = [
                (n, m)
                for n, m in model.named_modules()
                if any(True for _ in m.parameters(recurse=False))
            ]
        else:
            chosen = []
            for item in modules:
                if isinstance(item, str):
                    try:
                        chosen.append((item, model.get_submodule(item)))
                    except AttributeError:
                        raise ValueError(
                            f"No module '{item}' in {type(model).__name__}; known "
                            f"paths: {sorted(paths.values())[:12]}..."
                        ) from None
                elif isinstance(item, nn.Module) and id(item) in paths:
                    chosen.append((paths[id(item)], item))
                else:
                    raise TypeError(
                        f"modules must hold paths or submodules of the model, received {item!r}."
                    )
        self.modules: list[tuple[str, nn.Module]] = chosen
        self.stats: dict[tuple[str, str], RangeStats] = {}
        self.fp8: dict[str, FP8Stats] = {}  # the watched Linears that ran in FP8
        self._handles: list[Any] = []

    @property
    def loss_scale(self) -> float:
        if self._loss_scale is not None:
            return float(self._loss_scale)
        return self._observed_scale()

    def _observed_scale(self) -> float:
        opt = self.optimizer
        return float(opt.loss_scale) if opt is not None and hasattr(opt, "loss_scale") else 1.0

    def __enter__(self) -> RangeAudit:
        for path, m in self.modules:
            self._handles.append(m.register_forward_hook(self._hook_for(path)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _get(self, path: str, kind: str) -> RangeStats:
        key = (path, kind)
        if key not in self.stats:
            self.stats[key] = RangeStats()
        return self.stats[key]

    def _hook_for(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            layer = layers_of(self.model).get(path)
            fp8 = layer is not None and layer.active and isinstance(output, Tensor) and args
            if fp8:
                stats = self.fp8.setdefault(path, FP8Stats(layer.recipe.name))
                stats.add_forward(module, layer.recipe, args[0], output)
                if output.requires_grad:
                    output.register_hook(lambda g: stats.add_grad(layer.recipe, g))
            for t in iter_tensors(output):
                if not t.is_floating_point():
                    continue
                self._get(path, "activation").add(t)
                if t.requires_grad:
                    t.register_hook(self._grad_hook(path))

        return hook

    def _grad_hook(self, path: str) -> Any:
        def hook(g: Tensor) -> None:
            observed = self._observed_scale()
            self._get(path, "gradient").add(g, divide=observed, scale=self.loss_scale)

        return hook

    # -- results -----------------------------------------------------------------------------
    def merged(self, kind: str = "gradient") -> RangeStats:
        """All watched modules' statistics of ``kind`` added together."""
        if kind not in _KINDS:
            raise ValueError(f"kind={kind!r} is not one of {_KINDS}.")
        out = RangeStats()
        for (_, k), s in self.stats.items():
            if k != kind:
                continue
            out.hist += s.hist
            out.zeros += s.zeros
            out.nonfinite += s.nonfinite
            out.nonzero += s.nonzero
            out.absmax = max(out.absmax, s.absmax)
            out.absmin = min(out.absmin, s.absmin)
            for d in _DTYPES:
                out.underflow[d] += s.underflow[d]
                out.subnormal[d] += s.subnormal[d]
                out.overflow[d] += s.overflow[d]
        return out

    def recommended_loss_scale(self, dtype: torch.dtype = torch.float16) -> float:
        """The largest power of two keeping the largest gradient 2x below ``dtype``'s max.

        bf16 has fp32's range: 1.0. Without gradients seen, 2**16 (the usual start).
        """
        if dtype == torch.bfloat16:
            return 1.0
        absmax = self.merged("gradient").absmax
        if absmax <= 0:
            return 2.0**16
        k = math.floor(math.log2(torch.finfo(dtype).max / (2 * absmax)))
        return float(2.0 ** min(max(k, 0), 24))

    def summary(self, dtype: str = "fp16") -> list[dict[str, Any]]:
        """One row per (module, kind): counts, abs-max and the underflow/overflow fractions."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {tuple(_DTYPES)}.")
        rows = []
        for (path, kind), s in sorted(self.stats.items()):
            f = s.fractions(dtype)
            rows.append(
                {
                    "module": path or "<model>",
                    "kind": kind,
                    "values": s.nonzero + s.zeros,
                    "zero": s.zeros / max(s.nonzero + s.zeros, 1),
                    "absmax": s.absmax,
                    **f,
                }
            )
        return rows

    def table(self, dtype: str = "fp16") -> str:
        head = ["module", "kind", "values", "zero", "absmax", "underflow", "subnormal", "overflow"]
        rows = [
            [
                r["module"],
                r["kind"],
                str(r["values"]),
                f"{r['zero']:.1%}",
                f"{r['absmax']:.3g}",
                f"{r['underflow']:.2%}",
                f"{r['subnormal']:.2%}",
                f"{r['overflow']:.2%}",
            ]
            for r in self.summary(dtype)
        ]
        widths = [
            max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
        ]
        lines = [
            f"range audit ({dtype}, gradients at loss scale {self.loss_scale:g})",
            "  ".join(h.ljust(w) for h, w in zip(head, widths)),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        if self.fp8:
            lines += ["", self.fp8_table()]
        return "\n".join(lines)

    def fp8_table(self) -> str:
        """One row per FP8 layer: its recipe; amax, fraction outside the FP8 range at the scale
        used (underflow + overflow) and cast SQNR of the input, weight and gradient; and the
        SQNR of its output against the 16-bit layer."""

        def cells(c: CastStats | None) -> list[str]:
            if c is None:
                return ["-", "-", "-"]
            return [f"{c.amax:.3g}", f"{c.underflow + c.overflow:.2%}", f"{c.sqnr:.1f}"]

        head = ["FP8 layer", "recipe"]
        for what in ("input", "weight", "grad"):
            head += [f"{what} amax", "outside", "SQNR dB"]
        head.append("output SQNR vs 16-bit")
        rows = [
            [p, s.recipe, *cells(s.input), *cells(s.weight), *cells(s.grad), f"{s.output_sqnr:.1f}"]
            for p, s in sorted(self.fp8.items())
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fp8": {p: s.as_dict() for p, s in sorted(self.fp8.items())},
            "loss_scale": self.loss_scale,
            "recommended_loss_scale_fp16": self.recommended_loss_scale(torch.float16),
            "modules": {
                f"{p or '<model>'}:{k}": s.as_dict() for (p, k), s in sorted(self.stats.items())
            },
        }

    def plot(
        self, path: str, kind: str = "gradient", dtypes: Sequence[torch.dtype] = (torch.float16,)
    ) -> str:
        """Write a PNG histogram of log2|values| in the style of Micikevicius et al., Fig. 3."""
        from mixprec.numerics.range_plot import plot_histogram

        return plot_histogram(self, path, kind, dtypes, exp_min=EXP_MIN)


def range_audit(
    model: nn.Module,
    modules: Iterable[str | nn.Module] | None = None,
    *,
    loss_scale: float | None = None,
    optimizer: Any = None,
) -> RangeAudit:
    """Context manager: histogram activations and gradients of ``modules`` and judge their range.

    Example::

        with mixprec.numerics.range_audit(model) as audit:
            loss_fn(model(x), y).backward()          # an fp32 step
        print(audit.table("fp16"), audit.recommended_loss_scale())
    """
    return RangeAudit(model, modules, loss_scale=loss_scale, optimizer=optimizer)
