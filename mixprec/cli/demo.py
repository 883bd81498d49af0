"""``mixprec demo``: train the Keras guide's model on MNIST-1D in fp32 and in mixed precision.

The model is the Keras mixed-precision guide's MLP (input -> 4096 -> 4096 -> 10, float32
softmax cross-entropy), with the input width adapted to MNIST-1D's 40 features. The data is
generated locally by the ``mnist1d`` package (nothing is downloaded). It is the ``seed-mlp``
workload of ``mixprec bench``, trained by the same round-robin runner
(:func:`mixprec.bench.runner.run_workload`).

Design choices:

* **Modes take turns.** Every round gives each mode one optimizer step, in turn, and only that
  step is timed, so all modes see the same machine load at the same moments. Timed one after
  another, on a busy host the winner could swap between two runs.
* **Medians and their spread.** The table shows each mode's median step and the middle half of
  its steps (25th-75th percentile); "vs fp32" is the ratio of the two medians shown. The
  verdict adds the middle half of the per-round ratios, and says when another mode's ratio lies
  inside it: then this run does not tell the two apart.
* **One claim, one mode.** The verdict has one line per claim (speed, accuracy, memory), and
  each line names the mode its numbers belong to.
* **Hardware-honest.** The demo asks :func:`mixprec.check` which 16-bit dtype is fast on the
  device. Where none is (a CPU without AVX512_BF16/AMX emulates bf16 matmuls, tens of times
  slower than fp32), the 16-bit levels still run -- O2/O3 still cut memory there -- on a
  narrower MLP (:data:`SLOW_WIDTH`), and the rounds stop once a 16-bit level has trained a time
  budget, so the demo finishes in about its usual time; every mode still runs the same steps,
  so the accuracies compare. The verdict then says plainly that 16-bit costs time here. A
  ratio below 1 is never called a speed-up.
* **What a slow host gets instead.** There a row of its own races storage-only precision
  (``Recipe("lean", dtype, compute="fp32")``: 16-bit weights, 8-bit optimizer states, fp32
  matmuls) in the same rounds, and the verdict picks between it, fp32 and the 16-bit levels
  from this run's step ratios and peak memory, next to the recipe table's bytes per parameter.
  Where the dtype is fast the rows are the levels alone.
* Peak memory is measured after the rounds, one mode at a time (resident memory cannot be split
  between several live models).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch

import mixprec
from mixprec._core.hardware import MixprecPerformanceWarning
from mixprec.bench import runner
from mixprec.bench.models import SeedMLP
from mixprec.bench.report import milliseconds, speed_words
from mixprec.bench.runner import ModeResult, quartiles, round_ratios
from mixprec.bench.workloads import WORKLOADS, BenchWorkload
from mixprec.cli.progress import make_progress

__all__ = [
    "HEADERS",
    "SLOW_WIDTH",
    "STORAGE",
    "format_results",
    "pick_dtype",
    "run_demo",
    "speed_words",
    "verdict",
]

SLOW_WIDTH = 512  # the MLP's width where 16-bit is emulated: 1/64 of the FLOPs of 4096
MIN_STEPS = 3  # a time budget never stops a mode before it has this many steps
_MODE = {"O0": "fp32", "O1": "O1", "O2": "O2", "O3": "O3"}  # level -> runner mode
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
STORAGE = "storage-only"  # the runner's mode for Recipe("lean", dtype, compute="fp32")


def _mlp(width: int, data: dict[str, torch.Tensor]) -> torch.nn.Module:
    return SeedMLP(data["x"].shape[1], width, 10)


def workload(width: int, batch: int) -> BenchWorkload:
    """The bench's seed-mlp workload with a ``width``-wide MLP and batch ``batch``."""
    wl = WORKLOADS["seed-mlp"]
    return dataclasses.replace(
        wl,
        make_model=functools.partial(_mlp, width),
        batch_size=batch,
        description=f"Keras-guide MLP (40-{width}-{width}-10) on MNIST-1D, AdamW 1e-3, "
        f"batch {batch}",
    )


def label(level: str, dtype: torch.dtype) -> str:
    """The mode's name in the table: ``fp32``, ``O2 bf16``, ..."""
    return "fp32" if level == "O0" else f"{level} {_SHORT.get(dtype, str(dtype))}"


def run_demo(
    steps: int = 60,
    levels: tuple[str, ...] | None = None,
    batch: int = 512,
    seed: int = 0,
    progress: bool = True,
    dtype: torch.dtype | None = None,
    budget: float = 20.0,
    width: int | None = None,
) -> dict[str, ModeResult]:
    """Train fp32 (``O0``, first) and the mixed ``levels`` in turns; results keyed by label.

    ``dtype`` None picks the fast 16-bit dtype :func:`mixprec.check` reports for the CPU. Where
    none is fast, bf16 runs anyway (for its memory), the MLP is ``SLOW_WIDTH`` wide unless
    ``width`` says otherwise, the rounds stop once a 16-bit level has trained ``budget``
    seconds (and at least ``MIN_STEPS`` steps), and storage-only precision in ``dtype`` runs
    last in every round (its row: :data:`STORAGE`).
    """
    report = mixprec.check("cpu", verbose=False)
    dtype = pick_dtype(report, dtype)
    slow = not report.is_fast(dtype)
    levels = tuple(levels or ("O0", "O1", "O2"))
    if not levels or levels[0] != "O0" or len(set(levels)) != len(levels):
        raise ValueError(
            f"levels must start with O0 (the fp32 baseline every ratio is against) and not "
            f"repeat a level; received {list(levels)}."
        )
    width = width or (SLOW_WIDTH if slow else 4096)
    modes = [_MODE[level] for level in levels] + ([STORAGE] if slow else [])
    names = {_MODE[level]: label(level, dtype) for level in levels}
    names[STORAGE] = f"{STORAGE} {_SHORT.get(dtype, str(dtype))}"
    with make_progress(progress) as ui, warnings.catch_warnings():
        if slow:  # the caller has told the user already; do not repeat it per level
            warnings.simplefilter("ignore", MixprecPerformanceWarning)
        tasks = {m: ui.add(names[m], steps) for m in modes}
        results = runner.run_workload(
            workload(width, batch),
            modes,
            dtype=dtype,
            batch_size=batch,
            steps=steps,
            time_budget=budget if slow else None,
            together=True,
            min_steps=MIN_STEPS,
            seed=seed,
            eval_every=steps,
            on_step=lambda m, step, loss: ui.advance(tasks[m]),
        )
    return {names[m]: results[m] for m in modes}


def pick_dtype(report: Any, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, else the fast 16-bit dtype here, else bf16 (run anyway, for its memory)."""
    if dtype is not None:
        return dtype
    return report.best_dtype if report.best_dtype != torch.float32 else torch.bfloat16


def _middle_half_ms(seconds: list[float]) -> str:
    low, _, high = quartiles(seconds)
    return f"{milliseconds(low).removesuffix('ms')}–{milliseconds(high).removesuffix('ms')} ms"


def _ms(seconds: float) -> str:
    return milliseconds(seconds).replace("ms", " ms")


def _mb(r: ModeResult) -> str:
    return "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f} MB"


def format_results(results: dict[str, ModeResult]) -> list[list[str]]:
    """Rows for the demo table; "vs fp32" is the ratio of the medians shown."""
    base = next(iter(results.values()))
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                str(len(r.step_times)),
                _ms(r.median_step),
                _middle_half_ms(r.step_times[1:] or r.step_times),
                "baseline" if r is base else speed_words(base.median_step / r.median_step),
                "-" if r.final_metric is None else f"{r.final_metric * 100:.1f}%",
                f"{r.train_losses[-1]:.3f}" if r.train_losses else "-",
                _mb(r),
                str(r.skipped_steps),
            ]
        )
    return rows


HEADERS = [
    "mode",
    "steps",
    "median step",
    "middle half",
    "vs fp32",
    "test acc",
    "final loss",
    "peak mem",
    "skipped",
]
NOTE = (
    "median step and middle half (25th-75th percentile) over the steps after the first; "
    "vs fp32 = ratio of the median steps."
)


def verdict(results: dict[str, ModeResult], report: Any, dtype: torch.dtype) -> str:
    """What mixed precision gets the user on this machine: one line per claim, each naming
    the mode its numbers come from; with a storage-only row, its claim and which to pick."""
    names = list(results)
    base, others = results[names[0]], {n: results[n] for n in names[1:]}
    mixed = {n: r for n, r in others.items() if r.mode != STORAGE}  # the 16-bit-compute levels
    if not others:
        return "Only fp32 ran: nothing to compare."
    lines, faster = _speed_claim(base, mixed, report, dtype) if mixed else ([], False)
    steps = len(base.step_times)
    accuracy = ", ".join(
        f"{n} {r.final_metric:.1%}" for n, r in results.items() if r.final_metric is not None
    )
    lines.append(f"Accuracy after {steps} steps each, same batches: {accuracy}.")
    lines.append(_memory_claim(base, others))
    for n, r in others.items():
        if r.mode == STORAGE:
            lines += _storage_claim(n, r, base, mixed, dtype)
    if not faster and not report.is_fast(dtype):
        lines.append(
            "On a GPU (tensor cores) or a CPU with AVX512_BF16/AMX expect 16-bit steps to be "
            "faster than fp32."
        )
    return "\n".join(lines)


def _speed_claim(
    base: ModeResult, mixed: dict[str, ModeResult], report: Any, dtype: torch.dtype
) -> tuple[list[str], bool]:
    """The speed line of the fastest mixed mode, and the modes this run cannot tell from it;
    with whether that mode was faster than fp32."""
    ratio = {n: base.median_step / r.median_step for n, r in mixed.items()}
    fast = max(ratio, key=ratio.__getitem__)
    per_round = round_ratios(base.step_times, mixed[fast].step_times)
    faster = ratio[fast] >= 1.005
    # the spread in the claim's own direction: "x faster" (fp32 / mode) or "x fp32's" (mode / fp32)
    low, _, high = quartiles(per_round if faster else [1 / r for r in per_round])
    medians = f"median step {_ms(mixed[fast].median_step)} vs fp32's {_ms(base.median_step)}"
    spread = (
        f"per-round ratio {low:.2f}–{high:.2f}x in the middle half of the {len(per_round)} "
        "rounds after the first"
    )
    if faster:
        lines = [
            f"Speed: {fast} is the fastest mode, {speed_words(ratio[fast])} than fp32 here "
            f"({medians}; {spread})."
        ]
    else:
        support = report.dtypes.get(str(dtype).replace("torch.", ""))
        why = (
            f"16-bit is not faster here ({support.reason if support else 'no fast 16-bit unit'})"
            if not report.is_fast(dtype)
            else "no mixed mode was faster than fp32 on this run"
        )
        lines = [
            f"Speed: {why}: {fast}, the fastest 16-bit mode, takes {1 / ratio[fast]:.1f}x "
            f"fp32's median step ({medians}; {spread})."
        ]
    for n in mixed:
        if n != fast and low <= (ratio[n] if faster else 1 / ratio[n]) <= high:
            what = speed_words(ratio[n]) if faster else f"{1 / ratio[n]:.1f}x fp32's median step"
            lines.append(
                f"{n} ({what}) is within that spread: this run does not tell it apart from {fast}."
            )
    return lines, faster


def _memory_claim(base: ModeResult, mixed: dict[str, ModeResult]) -> str:
    measured = {n: r for n, r in mixed.items() if r.peak_bytes is not None}
    if base.peak_bytes is None or not measured:
        return "Memory: not measured on this device."
    leanest = min(measured, key=lambda n: measured[n].peak_bytes)
    saved = 1 - measured[leanest].peak_bytes / base.peak_bytes if base.peak_bytes else 0.0
    if saved <= 0:
        return f"Memory: no mixed mode used less peak memory than fp32 ({_mb(base)})."
    return (
        f"Memory: {leanest} uses {saved:.0%} less peak memory than fp32 "
        f"({_mb(measured[leanest])} vs {_mb(base)})."
    )


def _storage_claim(
    name: str, so: ModeResult, base: ModeResult, mixed: dict[str, ModeResult], dtype: torch.dtype
) -> list[str]:
    """The storage-only row's step and memory against fp32's, with its table's bytes per
    parameter, and which mode to pick by this run's numbers."""
    per_round = round_ratios(so.step_times, base.step_times)  # its step / fp32's, per round
    low, _, high = quartiles(per_round)
    cost = so.median_step / base.median_step
    saved = None
    if so.peak_bytes is not None and base.peak_bytes:
        saved = 1 - so.peak_bytes / base.peak_bytes
    if saved is None:
        memory = "peak memory not measured on this device"
    else:
        less = f"{saved:.0%} less" if saved > 0 else "no less"
        memory = f"{less} peak memory than fp32 ({_mb(so)} vs {_mb(base)})"
    table = mixprec.Recipe("lean", dtype, compute="fp32").loop_bytes()["plain"]
    fp32 = mixprec.Recipe("O0").loop_bytes()["plain"]
    claim = (
        f"Storage-only: {name} (Recipe('lean', {dtype}, compute='fp32'): "
        f"{_SHORT.get(dtype, str(dtype))} weights and 8-bit optimizer states, every matmul in "
        f"fp32; by its table {table:.1f} B/param of training state with AdamW against fp32's "
        f"{fp32:.1f}) takes {cost:.2f}x fp32's median step (median step "
        f"{_ms(so.median_step)} vs fp32's {_ms(base.median_step)}; per-round ratio "
        f"{low:.2f}–{high:.2f}x in the middle half of the {len(per_round)} rounds after the "
        f"first) and uses {memory}."
    )
    return [claim, _pick(name, so, base, mixed, low, saved)]


def _pick(
    name: str,
    so: ModeResult,
    base: ModeResult,
    mixed: dict[str, ModeResult],
    low: float,
    saved: float | None,
) -> str:
    """Which mode this run's numbers favour: storage-only where it saved memory at fp32's step
    (``low``, the 25th percentile of its per-round step ratio to fp32, at most 1) and no 16-bit
    level stepped faster; where it was slower than fp32, storage-only for memory and fp32 for
    time; otherwise what the numbers say instead."""
    cost = so.median_step / base.median_step
    if saved is None:
        return (
            f"Pick: this run cannot say: peak memory was not measured, and {name} takes "
            f"{cost:.2f}x fp32's median step."
        )
    if saved <= 0:
        return (
            f"Pick: fp32: {name} used no less peak memory than fp32 on this run, so its 16-bit "
            "storage bought nothing here."
        )
    best = min(mixed, key=lambda n: mixed[n].median_step) if mixed else None
    if best is not None and mixed[best].median_step < so.median_step:
        return (
            f"Pick: {best} rather than {name}: its median step was shorter on this run "
            f"({mixed[best].median_step / base.median_step:.2f}x fp32's against {cost:.2f}x); "
            "the Memory line compares their memory."
        )
    levels = "" if best is None else _levels_cost(so, base, mixed, best)
    if low <= 1.0:
        return (
            f"Pick: {name}: it used {saved:.0%} less peak memory than fp32, and this run does "
            f"not tell its step from fp32's (a quarter of its rounds or more were as fast){levels}."
        )
    return (
        f"Pick: {name} where memory is the aim ({saved:.0%} less peak memory than fp32 for "
        f"{cost:.2f}x its median step), fp32 where step time is{levels}."
    )


def _levels_cost(so: ModeResult, base: ModeResult, mixed: dict[str, ModeResult], best: str) -> str:
    """What the 16-bit-compute levels would cost instead: their best step against fp32's, and
    the leanest of them where it used less peak memory than storage-only."""
    text = (
        f"; the 16-bit-compute levels took {mixed[best].median_step / base.median_step:.1f}x "
        "fp32's median step at best"
    )
    measured = {n: r for n, r in mixed.items() if r.peak_bytes is not None}
    lean = min(measured, key=lambda n: measured[n].peak_bytes) if measured else None
    if lean is not None and so.peak_bytes is not None and measured[lean].peak_bytes < so.peak_bytes:
        text += f" (the leanest, {lean}, {_mb(measured[lean])} against its {_mb(so)})"
    return text
