"""``mixprec demo``: train the Keras guide's model on MNIST-1D in fp32 and in mixed precision.

The model is the Keras mixed-precision guide's MLP (input -> 4096 -> 4096 -> 10, float32
softmax cross-entropy), with the input width adapted to MNIST-1D's 40 features. The data is
generated locally by the ``mnist1d`` package (nothing is downloaded). Each mode trains the same
model from the same seed on the same batches; the table compares median step time, test
accuracy, peak memory and skipped steps side by side.

Hardware-honest by design: the demo asks :func:`mixprec.check` which 16-bit dtype is fast on
the device. Where none is (a CPU without AVX512_BF16/AMX emulates bf16 matmuls, tens of times
slower than fp32), the 16-bit levels still run -- O2/O3 still cut memory there -- but each
stops after a time budget, so the demo finishes in about its usual time, and the verdict says
plainly that mixed precision costs time on this machine. A ratio below 1 is never called a
speed-up.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import SeedMLP
from mixprec.bench.report import speed_words
from mixprec.bench.workloads import load_mnist1d
from mixprec.cli.progress import make_progress
from mixprec.core.hardware import MixprecPerformanceWarning
from mixprec.core.memory import PeakMemory

__all__ = ["DemoResult", "format_results", "run_demo", "speed_words", "verdict"]


@dataclass
class DemoResult:
    mode: str
    median_step: float
    accuracy: float
    first_loss: float
    final_loss: float
    peak_bytes: int | None
    skipped_steps: int
    steps: int = 0


def _batches(n: int, batch: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        for idx in torch.randperm(n, generator=g).split(batch):
            if len(idx) == batch and done < steps:
                done += 1
                yield idx


def train_one(
    data: dict[str, torch.Tensor],
    level: str,
    dtype: torch.dtype | None,
    steps: int,
    batch: int = 512,
    lr: float = 1e-3,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
    time_budget: float | None = None,
    hidden: int = 4096,
) -> DemoResult:
    """Train the seed MLP at ``level`` for ``steps`` steps and evaluate on the test split.

    With ``time_budget`` (seconds) training stops early once it has used that much time (after
    at least 3 steps); ``DemoResult.steps`` says how many ran.
    """
    x, y = data["x"], data["y"]
    times: list[float] = []
    losses: list[float] = []
    with PeakMemory() as mem:
        torch.manual_seed(seed)
        model = SeedMLP(x.shape[1], hidden, 10)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        model, opt = mixprec.initialize(model, opt, level=level, dtype=dtype)
        for idx in _batches(len(x), batch, steps, seed):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step()
            if time_budget is not None and len(times) >= 3 and sum(times) > time_budget:
                break
    model.eval()
    with torch.no_grad():
        pred = model(data["x_test"]).argmax(-1)
    accuracy = (pred == data["y_test"]).float().mean().item()
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    name = "fp32" if level == "O0" else f"{level} {short.get(dtype, str(dtype))}"
    return DemoResult(
        name,
        statistics.median(times[2:] or times),
        accuracy,
        losses[0],
        losses[-1],
        mem.peak_bytes,
        opt.skipped_steps,
        len(times),
    )


def run_demo(
    steps: int = 60,
    levels: tuple[str, ...] | None = None,
    batch: int = 512,
    seed: int = 0,
    progress: bool = True,
    dtype: torch.dtype | None = None,
    budget: float = 20.0,
) -> list[DemoResult]:
    """Train in fp32 and mixed levels; return one result per mode.

    ``dtype`` None picks the fast 16-bit dtype :func:`mixprec.check` reports for the CPU. Where
    none is fast, bf16 runs anyway (for its memory) and each 16-bit level stops after ``budget``
    seconds of training.
    """
    report = mixprec.check("cpu", verbose=False)
    dtype = pick_dtype(report, dtype)
    slow = not report.is_fast(dtype)
    hidden = SLOW_WIDTH if slow else 4096
    levels = levels or ("O0", "O1", "O2")
    data = load_mnist1d()
    results = []
    bar = make_progress(progress)
    with bar as ui, warnings.catch_warnings():
        if slow:  # the caller has told the user already; do not repeat it per level
            warnings.simplefilter("ignore", MixprecPerformanceWarning)
        for level in levels:
            task = ui.add(f"{'fp32' if level == 'O0' else level}", steps)
            results.append(
                train_one(
                    data,
                    level,
                    None if level == "O0" else dtype,
                    steps,
                    batch,
                    seed=seed,
                    on_step=lambda t=task: ui.advance(t),
                    time_budget=budget if slow and level != "O0" else None,
                    hidden=hidden,
                )
            )
    return results


SLOW_WIDTH = 1024  # the MLP's width where 16-bit is emulated: 1/16 of the FLOPs of 4096


def pick_dtype(report: Any, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, else the fast 16-bit dtype here, else bf16 (run anyway, for its memory)."""
    if dtype is not None:
        return dtype
    return report.best_dtype if report.best_dtype != torch.float32 else torch.bfloat16


def verdict(results: list[DemoResult], report: Any, dtype: torch.dtype) -> str:
    """What mixed precision gets the user on this machine, from the measured results."""
    base, mixed = results[0], results[1:]
    if not mixed:
        return "Only fp32 ran: nothing to compare."
    best = min(mixed, key=lambda r: r.median_step)
    ratio = base.median_step / best.median_step
    lean = min(mixed, key=lambda r: r.peak_bytes or 0)
    saved = (1 - lean.peak_bytes / base.peak_bytes) if lean.peak_bytes and base.peak_bytes else None
    memory = f"{lean.mode} uses {saved:.0%} less peak memory" if saved and saved > 0 else None
    name = str(dtype).replace("torch.", "")
    if ratio >= 1.005:
        text = (
            f"{best.mode} steps are {speed_words(ratio)} than fp32 here; test accuracy "
            f"{best.accuracy:.1%} vs {base.accuracy:.1%}"
        )
        return text + (f"; {memory}." if memory else ".")
    support = report.dtypes.get(name)
    why = support.reason if support is not None else "no fast 16-bit unit"
    text = (
        f"16-bit is not faster here ({why}): mixed precision costs "
        f"{1 / ratio:.1f}x the fp32 step time on this machine"
    )
    text += f", but {memory}." if memory else "."
    return text + (
        " On a GPU (tensor cores) or a CPU with AVX512_BF16/AMX expect 16-bit steps "
        "to be faster than fp32, with the same memory saving."
    )


def format_results(results: list[DemoResult]) -> list[list[str]]:
    """Rows for the demo table; speed is relative to the first (fp32) result."""
    base = results[0].median_step
    rows = []
    for r in results:
        mem = "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f} MB"
        rows.append(
            [
                r.mode,
                str(r.steps),
                f"{r.median_step * 1e3:.0f} ms",
                "baseline" if r is results[0] else speed_words(base / r.median_step),
                f"{r.accuracy * 100:.1f}%",
                f"{r.final_loss:.3f}",
                mem,
                str(r.skipped_steps),
            ]
        )
    return rows


HEADERS = ["mode", "steps", "step time", "vs fp32", "test acc", "final loss", "peak mem", "skipped"]
