"""Step-time and memory benchmarks: every mode in one process, as ratios, interleaved.

Design (measured on shared 2-core CI machines, see ``benchmarks/NOTES.md``): absolute times drift
10-20% over an hour and identical code differs by up to 7% between rounds, so each round times every
mode once, in turn, and a speed-up is the ratio of two modes' median steps from the same rounds --
never numbers from different runs. The table shows those medians next to the ratios, so one can be
checked against the other. Peak memory is measured in a separate pass (one mode at a time, model
and optimizer built inside the measurement) so the timing rounds are not disturbed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec._core.memory import PeakMemory
from mixprec.bench.models import GPT, GPTConfig, SeedMLP
from mixprec.bench.report import milliseconds
from mixprec.bench.runner import MODES, Trainer, reference
from mixprec.bench.workloads import BenchWorkload

__all__ = [
    "MODES",
    "WORKLOADS",
    "build_step",
    "count_casts",
    "emit",
    "format_table",
    "run",
    "step_workload",
]


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def step_workload(
    name: str,
    description: str,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    make_batch: Callable[[torch.Generator], tuple[Tensor, Tensor]],
    loss: Callable[[Tensor, Tensor], Tensor] = _ce,
) -> BenchWorkload:
    """A timing-only workload: one fixed random batch, repeated; nothing is evaluated."""

    def batches(data: Any, batch_size: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        batch = make_batch(torch.Generator().manual_seed(seed))
        while True:
            yield batch

    return BenchWorkload(
        name=name,
        description=description,
        metric="none",
        higher_is_better=False,
        target=float("nan"),
        batch_size=0,
        steps=0,
        quick_steps=0,
        eval_every=0,
        prepare=lambda quick, seed: None,
        make_model=lambda data: make_model(),
        make_optimizer=make_optimizer,
        batches=batches,
        loss=loss,
        evaluate=lambda forward, data: float("nan"),
        samples_per_batch=lambda b: b,
        example_batch=lambda data, b: make_batch(torch.Generator().manual_seed(0)),
    )


WORKLOADS: dict[str, BenchWorkload] = {
    "seed-mlp": step_workload(
        "seed-mlp",
        "Linear 784-4096-4096-10, ReLU, fp32 softmax cross-entropy, batch 512, SGD",
        lambda: SeedMLP(784, 4096, 10),
        lambda params: torch.optim.SGD(params, lr=0.01),
        lambda g: (torch.randn(512, 784, generator=g), torch.randint(0, 10, (512,), generator=g)),
    ),
    "gpt": step_workload(
        "gpt",
        "4 layers, width 384, 6 heads, context 256, batch 16, AdamW",
        lambda: GPT(GPTConfig()),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        lambda g: (
            torch.randint(0, 96, (16, 256), generator=g),
            torch.randint(0, 96, (16, 256), generator=g),
        ),
    ),
}


def build_step(
    workload: BenchWorkload, mode: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Callable[[], tuple[float, float]]:
    """Build model, optimizer and data for ``mode``; return a timed one-step function."""
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
    return Trainer(workload, None, mode, dtype, 0, seed).step


@dataclass
class Result:
    workload: str
    mode: str
    times: list[float] = field(default_factory=list)
    vs_fp32: float | None = None
    vs_torch: float | None = None
    peak_bytes: int | None = None
    final_loss: float | None = None
    casts: int | None = None  # cast kernels (aten::_to_copy) executed in one step

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(b) / statistics.median(a)  # speed-up of a over b


def run(
    workloads: list[str],
    modes: list[str],
    rounds: int = 7,
    warmup: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    memory: bool = True,
    casts: bool = True,
    log: Callable[[str], None] = print,
) -> list[Result]:
    """Time every mode of every workload in interleaved rounds; measure peak memory after."""
    results: list[Result] = []
    for wname in workloads:
        wl = WORKLOADS[wname]
        steps = {m: build_step(wl, m, dtype) for m in modes}
        res = {m: Result(wname, m) for m in modes}
        for r in range(warmup + rounds):
            for m in modes:
                dt, loss = steps[m]()
                if r >= warmup:
                    res[m].times.append(dt)
                res[m].final_loss = loss
            log(f"{wname}: round {r + 1}/{warmup + rounds} done")
        for m in modes:  # compiled modes against compiled references, eager against eager
            fp32, torch_amp = res.get(reference(m, "fp32")), res.get(reference(m))
            if fp32 is not None:
                res[m].vs_fp32 = _ratio(res[m].times, fp32.times)
            if torch_amp is not None:
                res[m].vs_torch = _ratio(res[m].times, torch_amp.times)
        del steps
        if casts:
            for m in modes:
                res[m].casts = count_casts(build_step(wl, m, dtype))
        if memory:
            for m in modes:
                with PeakMemory() as pm:
                    step = build_step(wl, m, dtype)
                    step()
                    step()
                    del step
                res[m].peak_bytes = pm.peak_bytes
        results.extend(res.values())
    return results


def count_casts(step: Callable[[], Any], warmup: int = 2) -> int:
    """Tensor cast kernels (``aten::_to_copy``) one training step runs, counted by the profiler.

    Casts that a compiler fused into other kernels do not run on their own and are not counted.
    """
    for _ in range(warmup):
        step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        step()
    # 0-dim casts are optimizer step counters and Python scalars, not tensors of the model
    return sum(
        1
        for e in prof.events()
        if e.name == "aten::_to_copy" and e.input_shapes and e.input_shapes[0]
    )


def emit(header: str, table: str, path: str | None, doc: dict[str, Any]) -> None:
    """Print a benchmark's header and table; write ``doc`` (with the header) to ``path``."""
    print()
    print(header)
    print()
    print(table)
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"header": header, **doc}, f, indent=1)


def format_table(results: list[Result]) -> str:
    """Markdown table of results: the speed-ups are ratios of the median steps shown, compiled
    modes against fp32 / torch.autocast under torch.compile (when those rows ran)."""

    def fmt(v: float | None, spec: str, suffix: str = "") -> str:
        return "-" if v is None else format(v, spec) + suffix

    lines = [
        "| workload | mode | median step (ms) | speed-up vs fp32 | vs torch.autocast | "
        "casts per step | peak memory (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = None if r.peak_bytes is None else r.peak_bytes / 2**20
        step = milliseconds(r.median).removesuffix("ms")
        lines.append(
            f"| {r.workload} | {r.mode} | {step} | {fmt(r.vs_fp32, '.2f', 'x')} "
            f"| {fmt(r.vs_torch, '.2f', 'x')} | {fmt(r.casts, 'd')} | {fmt(mem, '.0f')} |"
        )
    return "\n".join(lines)
