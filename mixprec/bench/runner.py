"""Train every mode of a workload side by side and measure what users care about.

Design: the machine drifts (10-20% within an hour), so modes are trained *round-robin*: each
round gives every mode one optimizer step, and only that step is timed. A mode's clock is the
sum of its own step times, so time-to-target compares modes that saw the same machine at the
same moments. Evaluation is not timed. Peak memory and the largest batch that fits a budget are
measured afterwards, one mode at a time, because resident memory cannot be attributed to one of
several live models.

Statistics: a mode's step time is the median of its steps (the first, warm-up step dropped), and
its speed-up is the ratio of two such medians, so a table can show the medians and the ratio
side by side and a reader can check one against the other. Both modes saw the same rounds, so
the ratio of medians needs no per-round pairing; the spread of the per-round ratios
(:func:`round_ratios`, :func:`quartiles`) says how far one run can be trusted.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import mixprec
from mixprec._core.memory import PeakMemory
from mixprec.bench.workloads import BenchWorkload

__all__ = [
    "MODES",
    "ModeResult",
    "Trainer",
    "is_compiled",
    "max_batch",
    "quartiles",
    "reference",
    "round_ratios",
    "run_workload",
    "time_to_target",
]

MODES = (
    "fp32",
    "torch-autocast",
    "mixprec-autocast",
    "O1",
    "O2",
    "O3",
    "lean",
    "storage-only",  # lean's storage with fp32 compute: Recipe("lean", dtype, compute="fp32")
    "graph",
    # compiled: torch.compile(model) on the eager mode's model, or the graph pass as a backend
    "fp32+compile",
    "torch-autocast+compile",
    "O1+compile",
    "O2+compile",
    "O3+compile",
    "lean+compile",
    "graph+compile",
    "graph-O3",
    "graph+compile-O3",
)
# the graph pass (mixprec.convert / mixprec.graph.compile) with O2's storage, or with O3's
_GRAPH = {"graph": "O2", "graph+compile": "O2", "graph-O3": "O3", "graph+compile-O3": "O3"}
_RECIPES = ("O1", "O2", "O3", "lean")  # mixprec.initialize with the named recipe
_FIELDS = {"storage-only": ("lean", {"compute": "fp32"})}  # a recipe with fields changed
_WRAPPED = (*_RECIPES, *_FIELDS, *_GRAPH)  # modes whose optimizer is mixprec's wrapper


def is_compiled(mode: str) -> bool:
    """Modes whose forward runs through torch.compile."""
    return mode.endswith("+compile") or mode.startswith("graph+compile")


def reference(mode: str, base: str = "torch-autocast") -> str:
    """The mode ``mode`` is compared with: ``base`` run the same way (compiled or eager), so
    compiled modes race ``torch.autocast`` + ``torch.compile``, never eager torch.autocast."""
    return base + "+compile" if is_compiled(mode) else base


@dataclass
class ModeResult:
    """Everything measured for one mode of one workload (JSON-ready via dataclasses.asdict)."""

    mode: str
    step_times: list[float] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # cumulative training time after each step
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, wall, metric)
    loss_scales: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    median_step: float = 0.0  # median of step_times without the first (warm-up) step
    throughput: float = 0.0  # samples (or tokens) per second at the median step
    speedup_vs_fp32: float | None = None  # fp32's median_step / this median_step
    speedup_vs_torch: float | None = None  # torch-autocast's median_step / this median_step
    final_metric: float | None = None
    time_to_target: float | None = None
    peak_bytes: int | None = None
    max_batch: int | None = None


def time_to_target(
    evals: list[tuple[int, float, float]], target: float, higher_is_better: bool
) -> float | None:
    """Training time at the first evaluation whose metric reaches ``target`` (None: never)."""
    for _, wall, metric in evals:
        if (metric >= target) if higher_is_better else (metric <= target):
            return wall
    return None


class Trainer:
    """One mode of one workload: a model, its optimizer and a timed ``step()``."""

    def __init__(
        self,
        wl: BenchWorkload,
        data: Any,
        mode: str,
        dtype: torch.dtype,
        batch_size: int,
        seed: int,
        options: dict[str, Any] | None = None,
    ):
        """``options``: :class:`mixprec.Recipe` fields for the mixprec levels (for example
        ``activations="fp8"``)."""
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
        self.wl, self.data, self.dtype = wl, data, dtype
        compiled = mode.endswith("+compile") and mode not in _GRAPH
        if compiled:  # how it trains, compiled or not
            mode = mode.removesuffix("+compile")
        self.mode = mode
        torch.manual_seed(seed)
        model = wl.make_model(data)
        opt = wl.make_optimizer(model.parameters())
        self.scaler = None
        if mode in _RECIPES or mode in _FIELDS:
            name, fields = _FIELDS.get(mode, (mode, {}))
            recipe = mixprec.Recipe(name, dtype, **{**fields, **(options or {})})
            model, opt = mixprec.initialize(model, opt, recipe)
        elif mode in _GRAPH:
            from mixprec import graph

            # the eager level's settings: 16-bit weights (with fp32 masters at O2), norms and
            # softmax on 16-bit inputs (fp32 inside), mixprec's kernels
            recipe = mixprec.Recipe(_GRAPH[mode], dtype)
            if mode.startswith("graph+compile"):
                model = graph.compile(model, recipe)
            else:
                x, _ = wl.example_batch(data, batch_size)
                model = graph.convert(model, (x,), recipe)
            model, opt = mixprec.initialize(model, opt, recipe)
        elif mode == "torch-autocast" and dtype == torch.float16:
            self.scaler = torch.amp.GradScaler("cpu" if _device(model) == "cpu" else "cuda")
        if compiled:  # as a user would: the same model and loop, the model compiled
            model = torch.compile(model)
        self.model: nn.Module = model
        self.opt: Any = opt
        self.batches: Iterator[tuple[Tensor, Tensor]] = wl.batches(data, batch_size, seed)
        self._torch_skips = 0

    def region(self) -> contextlib.AbstractContextManager:
        if self.mode == "torch-autocast":
            return torch.autocast(_device(self.model), self.dtype)
        if self.mode == "mixprec-autocast":
            return mixprec.autocast(self.dtype)
        return contextlib.nullcontext()

    def forward(self, x: Tensor) -> Tensor:
        with self.region():
            return self.model(x)

    def step(self) -> tuple[float, float]:
        """One training step; returns ``(seconds, loss)``."""
        x, y = next(self.batches)
        t0 = time.perf_counter()
        with self.region():
            loss = self.wl.loss(self.model(x), y)
        if self.mode in _WRAPPED:
            self.opt.backward(loss)
            self.opt.step()
        elif self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self._torch_skips += self.scaler.get_scale() < before
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = loss.item()
        return time.perf_counter() - t0, value

    @property
    def loss_scale(self) -> float:
        if self.mode in _WRAPPED:
            return float(self.opt.loss_scale)
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return int(self.opt.skipped_steps) if self.mode in _WRAPPED else self._torch_skips

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        try:
            return float(self.wl.evaluate(self.forward, self.data))
        finally:
            self.model.train()


def _device(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _peak(
    wl: BenchWorkload,
    data: Any,
    mode: str,
    dtype: torch.dtype,
    batch: int,
    seed: int,
    steps: int = 2,
) -> int | None:
    with PeakMemory() as mem:
        trainer = Trainer(wl, data, mode, dtype, batch, seed)
        for _ in range(steps):
            trainer.step()
        del trainer
    return mem.peak_bytes


def max_batch(
    wl: BenchWorkload,
    data: Any,
    mode: str,
    dtype: torch.dtype,
    budget_bytes: int,
    start: int,
    seed: int = 0,
    limit: int = 6,
) -> int | None:
    """The largest of ``start * 2**k`` (k < ``limit``) whose training step fits the budget."""
    best = None
    batch = start
    for _ in range(limit):
        peak = _peak(wl, data, mode, dtype, batch, seed, steps=1)
        if peak is None or peak > budget_bytes:
            break
        best, batch = batch, batch * 2
    return best


def run_workload(
    wl: BenchWorkload,
    modes: list[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int | None = None,
    steps: int | None = None,
    time_budget: float | None = None,
    quick: bool = False,
    seed: int = 0,
    eval_every: int | None = None,
    memory: bool = True,
    max_batch_mb: float | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
    together: bool = False,
    min_steps: int = 1,
) -> dict[str, ModeResult]:
    """Train ``modes`` round-robin on ``wl``; return their results keyed by mode.

    ``time_budget`` (seconds of a mode's own training time) stops a mode once its clock has
    reached it and it has run ``min_steps`` steps; the others go on. With ``together`` the
    first mode to get there ends the run for every mode after that round, so all modes run the
    same steps (comparable accuracies, every round paired).
    """
    batch = batch_size or wl.batch_size
    steps = steps or (wl.quick_steps if quick else wl.steps)
    every = eval_every or (max(1, steps // 5) if quick else wl.eval_every)
    data = wl.prepare(quick, seed)
    trainers = {m: Trainer(wl, data, m, dtype, batch, seed) for m in modes}
    results = {m: ModeResult(m) for m in modes}
    for m, t in trainers.items():
        results[m].evals.append((0, 0.0, t.evaluate()))
    clock = dict.fromkeys(modes, 0.0)

    def spent(m: str) -> bool:
        return (
            time_budget is not None
            and clock[m] >= time_budget
            and len(results[m].step_times) >= min_steps
        )

    for step in range(1, steps + 1):
        for m, t in trainers.items():
            if spent(m):
                continue
            dt, loss = t.step()
            clock[m] += dt
            r = results[m]
            r.step_times.append(dt)
            r.train_losses.append(loss)
            r.wall.append(clock[m])
            r.loss_scales.append(t.loss_scale)
            if step % every == 0 or step == steps:
                r.evals.append((step, clock[m], t.evaluate()))
            if on_step is not None:
                on_step(m, step, loss)
        if (any if together else all)(spent(m) for m in modes):
            break
    for m, t in trainers.items():
        r = results[m]
        r.skipped_steps = t.skipped_steps
        if r.evals[-1][0] != len(r.step_times):
            r.evals.append((len(r.step_times), clock[m], t.evaluate()))
    del trainers
    _summarize(wl, results, batch)
    for m in modes if memory else ():
        results[m].peak_bytes = _peak(wl, data, m, dtype, batch, seed, steps=1 if quick else 2)
    if max_batch_mb is not None:
        for m in modes:
            results[m].max_batch = max_batch(
                wl, data, m, dtype, int(max_batch_mb * 2**20), batch, seed
            )
    return results


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """``(25th percentile, median, 75th percentile)`` of ``values``; the outer two bound the
    middle half. One value is its own spread."""
    if not values:
        raise ValueError("quartiles of an empty list: no step was timed.")
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high


def round_ratios(base: list[float], other: list[float]) -> list[float]:
    """Per-round time ratios ``base / other`` (above 1: ``other`` is faster), warm-up dropped.

    Step ``i`` of every mode ran in round ``i``, so the pairs saw the same machine load.
    """
    pairs = list(zip(base, other))
    return [b / o for b, o in (pairs[1:] or pairs)]


def _summarize(wl: BenchWorkload, results: dict[str, ModeResult], batch: int) -> None:
    for r in results.values():
        times = r.step_times[1:] or r.step_times
        r.median_step = statistics.median(times)
        r.throughput = wl.samples_per_batch(batch) / r.median_step
        r.final_metric = r.evals[-1][2]
        r.time_to_target = time_to_target(r.evals, wl.target, wl.higher_is_better)
    for r in results.values():
        fp32 = results.get(reference(r.mode, "fp32"))
        torch_amp = results.get(reference(r.mode))
        if fp32 is not None:
            r.speedup_vs_fp32 = fp32.median_step / r.median_step
        if torch_amp is not None:
            r.speedup_vs_torch = torch_amp.median_step / r.median_step
