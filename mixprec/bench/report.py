"""What ``mixprec bench`` writes: a terminal table, a JSON file and PNG plots.

The JSON schema (``SCHEMA``) is versioned so that tools reading old results can tell; every
number in the table comes from the JSON, so the two cannot disagree. Version 2: the speed-ups
are ratios of the median steps (version 1 stored medians of per-round ratios).

Columns agree with each other: "per s" is the batch over the median step, and "vs fp32" / "vs
torch" are ratios of the median steps, so each can be recomputed from the numbers next to it
(step times are shown to three significant digits for that).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
from typing import Any

import torch

from mixprec.bench.runner import ModeResult
from mixprec.bench.workloads import BenchWorkload

__all__ = [
    "HEADERS",
    "NOTE",
    "SCHEMA",
    "markdown",
    "meta",
    "milliseconds",
    "rows",
    "speed_words",
    "to_json",
    "write_json",
    "write_plots",
]

SCHEMA = "mixprec.bench/2"
HEADERS = [
    "mode",
    "median step",
    "per s",
    "vs fp32",
    "vs torch",
    "peak",
    "final",
    "to target",
    "skip",
    "max batch",
]
NOTE = (
    "median step: over the steps after the first; per s: samples (tokens for char-gpt) per "
    "second at the median step; vs fp32, vs torch: ratios of the median steps."
)


def meta(command: str, dtype: torch.dtype, seed: int, quick: bool) -> dict[str, Any]:
    from mixprec._core.hardware import check

    report = check(verbose=False)
    return {
        "date": datetime.date.today().isoformat(),
        "device": report.device,
        "hardware": report.name,
        "features": list(report.features),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command,
        "dtype": str(dtype).replace("torch.", ""),
        "seed": seed,
        "quick": quick,
    }


def to_json(
    info: dict[str, Any], results: dict[str, tuple[BenchWorkload, dict[str, ModeResult]]]
) -> dict[str, Any]:
    """The JSON document for a run (see ``SCHEMA``)."""
    return {
        "schema": SCHEMA,
        "meta": info,
        "workloads": {
            name: {
                "metric": wl.metric,
                "higher_is_better": wl.higher_is_better,
                "target": wl.target,
                "description": wl.description,
                "modes": {m: dataclasses.asdict(r) for m, r in modes.items()},
            }
            for name, (wl, modes) in results.items()
        },
    }


def _round(obj: Any) -> Any:
    """Floats to 6 significant digits: timings are not more precise than that."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_round(v) for v in obj]
    return obj


def write_json(doc: dict[str, Any], path: pathlib.Path) -> None:
    """Write ``doc`` compactly (per-step lists make an indented file several times larger).

    The file is written next to ``path`` and then renamed over it, so a run stopped while
    writing (Ctrl-C) leaves the previous complete file, never a truncated one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_round(doc), separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def speed_words(ratio: float | None) -> str:
    """A time ratio (baseline / mode) in words: below 1 is a slowdown, never a speed-up."""
    if ratio is None:
        return "-"
    if ratio >= 1.005:
        return f"{ratio:.2f}x faster"
    if ratio <= 0.995:
        return f"{1 / ratio:.2f}x slower"
    return "same speed"


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{format(v, spec)}{suffix}"


def _sig3(v: float) -> str:
    """At least three significant digits: 1234 -> '1234', 5.214 -> '5.21', 0.8432 -> '0.843'."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.1f}" if v >= 10 else f"{v:.2f}"
    return f"{v:.3g}"


def milliseconds(seconds: float) -> str:
    """A step time in ms to three significant digits (at least): '5.21ms', '339ms'."""
    return f"{_sig3(seconds * 1e3)}ms"


def _si(v: float) -> str:
    return f"{_sig3(v / 1e3)}k" if v >= 1e3 else _sig3(v)


def _vs(modes: dict[str, ModeResult], base: str, r: ModeResult) -> str:
    """The time ratio of ``base``'s median step to ``r``'s, the two medians the table shows."""
    other = modes.get(base)
    if other is None or not r.median_step:
        return "-"
    return speed_words(other.median_step / r.median_step)


def rows(wl: BenchWorkload, modes: dict[str, ModeResult]) -> list[list[str]]:
    """Table rows for one workload ("per s": samples, or tokens for char-gpt, per second at the
    median step; "vs fp32" / "vs torch": ratios of the median steps shown)."""
    metric = "{:.1%}" if wl.metric == "accuracy" else "{:.3f}"
    out = []
    for r in modes.values():
        out.append(
            [
                r.mode,
                milliseconds(r.median_step),
                _si(r.throughput),
                _vs(modes, "fp32", r),
                _vs(modes, "torch-autocast", r),
                _fmt(None if r.peak_bytes is None else r.peak_bytes / 2**20, ".0f", "MB"),
                "-" if r.final_metric is None else metric.format(r.final_metric),
                _fmt(r.time_to_target, ".1f", "s"),
                str(r.skipped_steps),
                "-" if r.max_batch is None else str(r.max_batch),
            ]
        )
    return out


def markdown(wl: BenchWorkload, modes: dict[str, ModeResult]) -> str:
    """The table as Markdown, for docs/benchmarks.md."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(wl, modes)]
    return "\n".join(lines)


def write_plots(
    wl: BenchWorkload, modes: dict[str, ModeResult], out: pathlib.Path
) -> list[pathlib.Path]:
    """Loss and metric vs training time, loss scale over steps, step-time bars (PNG files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)

    def curves(axes: Any) -> None:
        ax1, ax2 = axes
        for r in modes.values():
            ax1.plot(r.wall, r.train_losses, label=r.mode, lw=1)
            ax2.plot([e[1] for e in r.evals], [e[2] for e in r.evals], marker="o", label=r.mode)
        ax2.axhline(wl.target, color="grey", ls="--", lw=1, label="target")
        ax1.set(xlabel="training time (s)", ylabel="train loss", title=f"{wl.name}: loss vs time")
        ax2.set(
            xlabel="training time (s)", ylabel=wl.metric, title=f"{wl.name}: {wl.metric} vs time"
        )

    def scales(ax: Any) -> None:
        for r in modes.values():
            ax.plot(range(1, len(r.loss_scales) + 1), r.loss_scales, label=r.mode)
        ax.set(xlabel="step", ylabel="loss scale", yscale="log", title=f"{wl.name}: loss scale")

    def bars(ax: Any) -> None:
        ax.bar(list(modes), [r.median_step * 1e3 for r in modes.values()], label="median step")
        ax.set(ylabel="median step (ms)", title=f"{wl.name}: step time")

    paths = []
    for suffix, draw, shape in (
        ("loss_vs_time", curves, (1, 2)),
        ("loss_scale", scales, (1, 1)),
        ("step_time", bars, (1, 1)),
    ):
        fig, axes = plt.subplots(*shape, figsize=(5.5 * shape[1], 3.8))
        draw(axes)
        for ax in axes if shape[1] > 1 else [axes]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{wl.name}_{suffix}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
